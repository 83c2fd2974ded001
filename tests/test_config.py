"""The one configuration (radixlang/config.py): a TOML file under flags under defaults, every bad
key or value named, and `radixlang config --print` writing a file that reads back the same."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib

import pytest

from radixlang.cli import main
from radixlang.config import (
    CONFIG_ENV,
    DTYPES,
    PREEMPTIONS,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    SETTINGS,
    ConfigError,
    add_engine_arguments,
    check_values,
    load_config,
)
from radixlang.model_files import DEFAULT_MODEL


def write(tmp_path, text: str, name: str = "radixlang.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_give_engine_and_server_arguments():
    config = load_config(None, {}, environ={})
    engine = config.engine_kwargs()
    assert engine["model"] == DEFAULT_MODEL and engine["dtype"] == "auto"
    assert engine["kv_memory"] == "1GiB" and "num_blocks" not in engine
    assert "threads" not in engine and "max_context" not in engine  # unset: the engine decides
    server = config.server_kwargs()
    assert (server["host"], server["port"], server["log_level"]) == ("127.0.0.1", 30000, "info")
    assert server["allowed_origins"] is None and server["api_key"] is None
    assert config.given == frozenset() and config.engine_kwargs(only_given=True) == {}


def test_a_flag_overrides_the_file_and_the_file_overrides_the_default(tmp_path):
    path = write(
        tmp_path,
        '[engine]\ndtype = "bfloat16"\nblock_size = 32\nthreads = 2\n'
        '[server]\nport = 8000\nallowed_origins = ["http://localhost:3000"]\n',
    )
    config = load_config(path, {"engine.dtype": "float32", "server.host": "0.0.0.0"}, environ={})
    engine = config.engine_kwargs()
    assert engine["dtype"] == "float32"  # the flag
    assert engine["block_size"] == 32 and engine["threads"] == 2  # the file
    assert engine["max_running_requests"] == 256  # the default
    server = config.server_kwargs()
    assert (server["host"], server["port"]) == ("0.0.0.0", 8000)
    assert server["allowed_origins"] == ["http://localhost:3000"]
    assert config.engine_kwargs(only_given=True) == {
        "dtype": "float32",
        "block_size": 32,
        "threads": 2,
    }
    assert config.source == path


def test_the_file_comes_from_config_or_else_the_environment(tmp_path):
    from_env = write(tmp_path, "[engine]\nseed = 7\n", "env.toml")
    from_flag = write(tmp_path, "[engine]\nseed = 9\n", "flag.toml")
    env = {CONFIG_ENV: str(from_env)}
    assert load_config(None, {}, environ=env).engine_kwargs()["seed"] == 7
    assert load_config(from_flag, {}, environ=env).engine_kwargs()["seed"] == 9
    with pytest.raises(ConfigError, match=f"\\${CONFIG_ENV} names .*missing.toml"):
        load_config(None, {}, environ={CONFIG_ENV: str(tmp_path / "missing.toml")})


def test_kv_memory_and_num_blocks_size_the_same_pool(tmp_path):
    both = write(tmp_path, '[engine]\nkv_memory = "1GiB"\nnum_blocks = 64\n')
    with pytest.raises(ConfigError, match=r"engine\.kv_memory or engine\.num_blocks, not both"):
        load_config(both, {}, environ={})
    in_file = write(tmp_path, '[engine]\nkv_memory = "64MiB"\n', "kv.toml")
    engine = load_config(in_file, {"engine.num_blocks": 100}, environ={}).engine_kwargs()
    assert engine["num_blocks"] == 100 and "kv_memory" not in engine  # the flag replaced it
    with pytest.raises(ConfigError, match=r"--kv-memory or --num-blocks, not both"):
        load_config(None, {"engine.kv_memory": "1GiB", "engine.num_blocks": 3}, environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[engine]\nkv_memry = "1GiB"\n',
            "unknown key 'engine.kv_memry' (did you mean kv_memory?)",
        ),
        ('[engine]\nblock_size = "x"\n', "engine.block_size must be a positive integer, got 'x'"),
        ("[engine]\nblock_size = 0\n", "engine.block_size must be a positive integer, got 0"),
        ("[engine]\nseed = true\n", "engine.seed must be an integer, got True"),
        ('[engine]\ndtype = "fp8"\n', "engine.dtype must be one of auto, float32, bfloat16"),
        ('[engine]\nkv_memory = "lots"\n', "engine.kv_memory must be a size such as '512MiB'"),
        ('[engine]\ndevice = "GPU please"\n', "engine.device must be a device such as 'cpu'"),
        ('[engine]\nschedule_policy = "lifo"\n', "engine.schedule_policy must be one of lpm"),
        ("[server]\nport = 70000\n", "server.port must be a port number from 0 to 65535"),
        ("[server]\ndrain_timeout = -1\n", "server.drain_timeout must be a number of seconds"),
        ('[server]\nallowed_origins = "http://a"\n', "server.allowed_origins must be a list"),
        (
            '[server]\nlog_levl = "info"\n',
            "unknown key 'server.log_levl' (did you mean log_level?)",
        ),
        ('model = "x"\n', "unknown key or table 'model': put it in the [engine] table"),
        ("[engin]\nseed = 1\n", "unknown key or table 'engin' (did you mean engine?)"),
        ("engine = 3\n", "'engine' must be a table"),
        ("[engine\n", "is not valid TOML"),
    ],
)
def test_a_bad_key_or_value_is_named(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, {}, environ={})
    assert message in str(e.value)
    assert str(path) in str(e.value)  # and the file it came from


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' not found"):
        load_config(tmp_path / "nope.toml", {}, environ={})


def test_the_printed_toml_reads_back_to_the_same_configuration(tmp_path):
    flags = {
        "engine.num_blocks": 512,
        "engine.max_context": 4096,
        "server.api_key": 'a "quoted" key\\',
        "server.allowed_origins": ("http://a.example", "http://b.example"),
        "server.drain_timeout": 2.5,
    }
    config = load_config(None, flags, environ={})
    path = write(tmp_path, config.to_toml())
    again = load_config(path, {}, environ={})
    assert again.values == config.values
    assert "# threads: unset" in config.to_toml()  # unset settings are comments
    assert json.loads(config.to_json())["server"]["allowed_origins"] == list(
        flags["server.allowed_origins"]
    )


def test_the_choices_agree_with_the_runtime():
    from radixlang.runtime.model_runner import DTYPES as RUNNER_DTYPES
    from radixlang.runtime.models.linear import QUANTIZATIONS as RUNNER_QUANTIZATIONS
    from radixlang.runtime.scheduler import Preemption, SchedulePolicy

    assert set(SCHEDULE_POLICIES) == {p.value for p in SchedulePolicy}
    assert set(PREEMPTIONS) == {p.value for p in Preemption}
    assert set(DTYPES) == {"auto", *RUNNER_DTYPES}
    assert QUANTIZATIONS == RUNNER_QUANTIZATIONS


def test_cpu_threads_is_another_spelling_of_threads():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert parser.parse_args(["--cpu-threads", "1"]).engine__threads == 1
    assert parser.parse_args(["--quantization", "int8"]).engine__quantization == "int8"


@pytest.mark.parametrize("size", ["512MiB", "2GiB", "1.5GB", "100", "64 kib", "0.5G", "x", "1 TB"])
def test_kv_memory_sizes_are_those_the_engine_reads(size):
    from radixlang.runtime.engine import parse_memory

    try:
        engine_reads = parse_memory(size) > 0
    except ValueError:
        engine_reads = False
    try:
        check_values({"engine": {"kv_memory": size}})
        accepted = True
    except ConfigError:
        accepted = False
    assert accepted == engine_reads


def test_every_setting_is_an_engine_or_serve_argument():
    import inspect

    from radixlang.cluster.replica_set import ReplicaSet
    from radixlang.config import CLUSTER_KEYS
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import create_app, serve

    engine = inspect.signature(Engine).parameters
    server = {*inspect.signature(serve).parameters, *inspect.signature(create_app).parameters}
    # The replica set's own settings name its arguments (``replicas``: the count).
    cluster = {*inspect.signature(ReplicaSet).parameters}
    assert set(CLUSTER_KEYS) <= cluster
    for name, setting in SETTINGS.items():
        if setting.key in CLUSTER_KEYS:
            continue
        assert setting.key in (engine if setting.section == "engine" else server), name


def test_config_print_writes_toml_and_json(tmp_path, capsys):
    path = write(tmp_path, '[engine]\ndtype = "bfloat16"\n[server]\nport = 8123\n')
    assert main(["config", "--print", "--config", str(path), "--dtype", "float16"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["engine"]["dtype"] == "float16" and printed["server"]["port"] == 8123
    assert printed["engine"]["model"] == DEFAULT_MODEL
    assert main(["config", "--json", "--config", str(path), "--kv-memory", "256MiB"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["engine"]["kv_memory"] == "256MiB" and as_json["engine"]["threads"] is None


def test_config_names_a_bad_key_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, '[engine]\nkv_memry = "1GiB"\n')
    assert main(["config", "--print", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'engine.kv_memry' (did you mean kv_memory?)" in err


def test_a_bad_flag_value_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "--print", "--block-size", "x"])
    assert e.value.code == 2
    assert "--block-size: must be a positive integer, got 'x'" in capsys.readouterr().err


def test_the_environment_variable_reaches_the_command(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, "[server]\nport = 9999\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert main(["config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["server"]["port"] == 9999


def test_a_bad_config_exits_2_from_a_real_process(tmp_path):
    path = write(tmp_path, '[engine]\nblock_size = "x"\n')
    cmd = [sys.executable, "-m", "radixlang.cli", "serve", "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "engine.block_size must be a positive integer, got 'x'" in done.stderr
    assert "Traceback" not in done.stderr


def test_generate_builds_its_engine_from_the_config_file(tmp_path, chat_model_dir, capsys):
    path = write(
        tmp_path,
        f'[engine]\nmodel = "{chat_model_dir}"\ndtype = "float32"\nblock_size = 8\n'
        'kv_memory = "8MiB"\n',
    )
    assert (
        main(["generate", "Hello", "--config", str(path), "--max-new-tokens", "2", "--json"]) == 0
    )
    stats = json.loads(capsys.readouterr().out)["stats"]
    from radixlang.model_files import load_model_files

    per_token = load_model_files(chat_model_dir).config.kv_bytes_per_token(4)  # float32
    pool_bytes = stats["blocks_total"] * 8 * per_token
    assert 4 * 2**20 < pool_bytes <= 8 * 2**20  # 8MiB of 8-token blocks, not the 1GiB default


def test_serve_takes_the_server_table_under_its_flags(tmp_path, chat_model_dir, monkeypatch):
    import radixlang.server.app

    served = {}

    def fake_serve(engine, **kwargs):  # records what `serve` was given instead of serving
        served.update(kwargs, engine=engine)
        engine.shutdown()

    monkeypatch.setattr(radixlang.server.app, "serve", fake_serve)
    monkeypatch.setenv("RADIXLANG_API_KEY", "from-env")
    path = write(
        tmp_path,
        f'[engine]\nmodel = "{chat_model_dir}"\nnum_blocks = 64\n'
        '[server]\nport = 8123\nmax_queued_requests = 5\nallowed_origins = ["http://a.example"]\n',
    )
    assert main(["serve", "--config", str(path), "--dtype", "float32", "--port", "9001"]) == 0
    assert served["port"] == 9001 and served["max_queued_requests"] == 5
    assert served["allowed_origins"] == ["http://a.example"] and served["api_key"] == "from-env"
    assert served["engine"].pool.num_blocks == 64
    assert str(served["engine"].runner.dtype) == "torch.float32"


def test_a_setting_the_engine_lacks_is_refused_by_name(monkeypatch):
    import radixlang.runtime.engine
    from radixlang.cli.commands import _engine_kwargs

    class OlderEngine:  # an Engine from before `threads`
        def __init__(
            self, model, dtype, device, kv_memory, block_size, max_running_requests,
            schedule_policy, seed,
        ): ...  # fmt: skip

    monkeypatch.setattr(radixlang.runtime.engine, "Engine", OlderEngine)
    assert _engine_kwargs(load_config(None, {}, environ={}))["dtype"] == "auto"
    config = load_config(None, {"engine.threads": 2}, environ={})
    with pytest.raises(ConfigError, match=r"engine\.threads is not supported"):
        _engine_kwargs(config)


def test_api_keys_file_json_and_toml(tmp_path):
    from radixlang.config import ConfigError, load_api_keys

    (tmp_path / "k.json").write_text('{"key-a": "alice", "key-b": "bob"}')
    (tmp_path / "k.toml").write_text('key-a = "alice"\n"key b" = "bob"\n')
    assert load_api_keys(tmp_path / "k.json") == {"key-a": "alice", "key-b": "bob"}
    assert load_api_keys(tmp_path / "k.toml") == {"key-a": "alice", "key b": "bob"}
    bad = {
        "missing.json": None,
        "broken.json": "{",
        "list.json": '["a"]',
        "empty.toml": "",
        "nested.toml": "[key]\nx = 1\n",
        "long.json": '{"k": "' + "t" * 257 + '"}',
        "blank.json": '{"k": ""}',
    }
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match="API-keys file"):
            load_api_keys(tmp_path / name)


def test_engine_config_is_the_engine_settings_table():
    """File, flags and keyword arguments make one EngineConfig: a field per [engine] setting,
    its default the table's, each value checked by the setting's kind."""
    import dataclasses

    from radixlang.config import ENGINE_SETTINGS, EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert fields == {s.key: s.default for s in ENGINE_SETTINGS}
    config = load_config(None, {"engine.block_size": 32, "engine.dtype": "float32"}, environ={})
    made = config.engine_config()
    assert made.block_size == 32 and made.dtype == "float32" and made.jump_forward is True
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        EngineConfig(deterministic="yes")
    assert EngineConfig(grammar_compile_timeout=None).grammar_compile_timeout is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.block_size = 8


def test_engine_takes_its_settings_as_keywords_or_as_a_config(tmp_path):
    import inspect

    from radixlang.config import ENGINE_SETTINGS, EngineConfig
    from radixlang.runtime.engine import Engine

    params = inspect.signature(Engine).parameters
    assert [s.key for s in ENGINE_SETTINGS if s.key != "model"] == [
        p for p in params if p not in ("model", "model_path", "background", "config")
    ]
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'kv_memry'.*kv_memory"):
        Engine(kv_memry="1GiB")
    with pytest.raises(TypeError, match="takes no other settings"):
        Engine(config=EngineConfig(), num_blocks=8)
