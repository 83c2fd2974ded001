"""The engine's CPU options on the tiny chat model: int8 weights, adaptive threads."""

from __future__ import annotations

import pytest
import torch

from radixlang.runtime import Engine
from radixlang.runtime.cpu_threads import ADAPT_ENV
from radixlang.runtime.models.linear import Int8Linear, Linear

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
PROMPT = list(range(100, 130))


def stepped(chat_model_dir, **kw) -> Engine:
    return Engine(
        chat_model_dir,
        num_blocks=64,
        block_size=4,
        dtype="float32",
        background=False,
        check_integrity_every_step=True,
        **kw,
    )


def run(engine: Engine, prompt, params):
    handle = engine.submit(prompt, params)
    while not handle.done:
        engine.step()
    return handle.result()


def test_int8_weights_generate_close_to_float32(chat_model_dir):
    plain = stepped(chat_model_dir)
    int8 = stepped(chat_model_dir, quantization="int8")
    layer = int8.runner.model.layers[0]
    assert all(isinstance(x, Int8Linear) for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(int8.runner.model.lm_head, Linear)  # the output layer keeps its dtype
    assert int8.runner.model.num_parameter_bytes < plain.runner.model.num_parameter_bytes
    assert int8.runner.describe()["quantization"] == "int8"
    out = run(int8, PROMPT, GREEDY)
    assert len(out.output_ids) == 6
    # One forward of the same tokens: int8 logits stay near float32's (random weights, so
    # greedy tokens may differ where two logits are close; the logits themselves may not).
    seq = [(PROMPT, 0, list(range(8)))]
    from radixlang.runtime import SequenceInput

    want = plain.runner.forward([SequenceInput(*s) for s in seq]).logits
    got = int8.runner.forward([SequenceInput(*s) for s in seq]).logits
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 0.05 * scale


def test_unknown_quantization_is_refused(chat_model_dir):
    with pytest.raises(ValueError, match="must be one of auto, none, int8, gguf, q8_0, q4_0"):
        stepped(chat_model_dir, quantization="int3")


def test_threads_adapt_by_default_on_cpu_and_stay_fixed_when_given(chat_model_dir, monkeypatch):
    monkeypatch.delenv(ADAPT_ENV)  # the suite's own default (tests/conftest.py) aside
    before = torch.get_num_threads()
    try:
        adaptive = stepped(chat_model_dir)
        assert adaptive._governor is not None
        run(adaptive, PROMPT, GREEDY)
        stats = adaptive.stats()
        assert stats["cpu_threads"] >= 1 and "cpu_thread_changes" in stats
        fixed = stepped(chat_model_dir, threads=1)
        assert fixed._governor is None
        assert fixed.stats()["cpu_threads"] == 1
        off = stepped(chat_model_dir, adapt_threads=False)
        assert off._governor is None and "cpu_thread_changes" not in off.stats()
    finally:
        torch.set_num_threads(before)


def test_the_environment_sets_whether_engines_adapt_by_default(chat_model_dir, monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(ADAPT_ENV, "0")  # what tests/conftest.py sets for the suite
        assert stepped(chat_model_dir)._governor is None
        assert stepped(chat_model_dir, adapt_threads=True)._governor is not None  # asked for
        monkeypatch.setenv(ADAPT_ENV, "1")
        assert stepped(chat_model_dir, threads=1)._governor is not None
        assert stepped(chat_model_dir, adapt_threads=False)._governor is None
        monkeypatch.setenv(ADAPT_ENV, "yes")
        with pytest.raises(ValueError, match="RADIXLANG_ADAPT_THREADS must be 0 or 1"):
            stepped(chat_model_dir)
    finally:
        torch.set_num_threads(before)
