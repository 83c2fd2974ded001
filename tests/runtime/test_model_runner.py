"""The model runner's edges: bad batches, KV storage sizing and copy-on-write, loading."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model

from radixlang.model_files import UnsupportedModelError
from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.kv_cache import KVCache, KVShape
from radixlang.runtime.model_runner import BatchError, ModelRunner, SequenceInput
from radixlang.runtime.models.linear import Linear, onednn_linear_available
from radixlang.runtime.models.rope import inverse_frequencies


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def runner(folder):
    return ModelRunner(folder, num_blocks=32, block_size=4)


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (SequenceInput([], 0, [0]), "at least one token"),
        (SequenceInput([1, 2], -1, [0]), "prefix_len"),
        (SequenceInput([1] * 9, 0, [0, 1]), "need 3 blocks"),
        (SequenceInput([1], 0, [32]), r"block ids must lie in \[0, 32\)"),
        (SequenceInput([160], 0, [0]), r"token ids must lie in \[0, 160\)"),
        (SequenceInput([1], 0, [0], top_logprobs=2), "needs return_logprobs"),
        (SequenceInput([1] * 10, 250, list(range(32))), "exceeds the model's context of 256"),
    ],
)
def test_bad_sequences_are_refused_before_anything_runs(runner, seq, message):
    before = runner.kv.k.clone()
    with pytest.raises(BatchError, match=message):
        runner.forward([SequenceInput([3, 4], 0, [5]), seq])
    assert torch.equal(runner.kv.k, before)  # the good sequence's K/V was not written either


def test_empty_batch_is_refused(runner):
    with pytest.raises(BatchError, match="at least one sequence"):
        runner.forward([])


def test_results_come_back_in_the_order_given(runner):
    a = SequenceInput([5], 0, [1])
    b = SequenceInput([7, 8, 9], 0, [2])
    together = runner.forward([a, b]).logits
    torch.testing.assert_close(together[0], runner.forward([a]).logits[0])
    torch.testing.assert_close(together[1], runner.forward([b]).logits[0])


def test_kv_cache_is_sized_from_the_budget():
    shape = KVShape(num_layers=3, kv_heads=2, head_dim=8)
    per_block = shape.bytes_per_block(16, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 8 * 2
    cache = KVCache.from_budget(shape, 10 * per_block + per_block // 2, 16, torch.bfloat16)
    assert cache.num_blocks == 10 and cache.num_bytes == 10 * per_block
    assert cache.describe()["num_tokens"] == 160
    assert cache.k.shape == (3, 10, 16, 2, 8) and cache.layers[1].k.is_contiguous()
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_budget(shape, per_block - 1)


def test_runner_reports_its_cache(folder):
    per_block = KVShape(2, 2, 16).bytes_per_block(16, torch.float32)
    runner = ModelRunner(folder, kv_budget_bytes=7 * per_block)
    info = runner.describe()
    assert info["kv_cache"]["num_blocks"] == 7 and info["max_context"] == 256
    assert info["weights_bytes"] > 0


def test_copy_on_write_hook_copies_only_the_valid_slots_in_every_layer(runner):
    pool = BlockPool(runner.num_blocks, runner.block_size, copy_hook=runner.copy_block)
    tokens = [11, 12, 13, 14, 15, 16]
    blocks = pool.alloc(2)
    runner.forward([SequenceInput(tokens, 0, blocks)])
    pool.incref([blocks[1]])  # a second holder of the partly filled block
    copy = pool.copy_on_write(blocks[1], 2)
    assert copy != blocks[1]
    kv = runner.kv
    assert torch.equal(kv.k[:, copy, :2], kv.k[:, blocks[1], :2])
    assert torch.equal(kv.v[:, copy, :2], kv.v[:, blocks[1], :2])
    # Continuing in the copy gives what continuing in the original gives.
    own = runner.forward([SequenceInput([17], 6, [blocks[0], copy])]).logits
    shared = runner.forward([SequenceInput([17], 6, blocks)]).logits
    torch.testing.assert_close(own, shared, atol=0, rtol=0)


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2'"):
        ModelRunner(tmp_path, num_blocks=4)


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        inverse_frequencies(16, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})


def test_missing_weight_is_named(tmp_path, folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        ModelRunner(tmp_path, num_blocks=4)


def test_sliding_window_keeps_the_models_context(tmp_path):
    make_tiny_model("mistral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(tmp_path, num_blocks=4)
    assert runner.max_context == 256 and runner.sliding_window == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(dtype, monkeypatch):
    weight = torch.randn(40, 24).to(dtype)
    bias = torch.randn(40).to(dtype)
    x = torch.randn(5, 24).to(dtype)
    want = torch.nn.functional.linear(x, weight, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(Linear(weight, bias)(x), want, atol=tol, rtol=tol)
    onednn_linear_available.cache_clear()
    monkeypatch.setenv("RADIXLANG_ONEDNN", "0")
    plain = Linear(weight, bias)
    assert plain.onednn is False
    torch.testing.assert_close(plain(x), want, atol=0, rtol=0)
    onednn_linear_available.cache_clear()


@pytest.mark.parametrize("mode", ["torch", "native"])
def test_attention_plans_are_built_once_per_forward_not_per_layer(runner, monkeypatch, mode):
    from radixlang.kernels import native, reference

    monkeypatch.setenv("RADIXLANG_KERNELS", mode)
    calls = []
    for module, name in [
        (reference, "plan_decode"),
        (native, "plan_decode"),
        (native, "plan_extend"),
    ]:
        original = getattr(module, name)

        def counting(*args, original=original, name=name, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    runner.forward([SequenceInput([3, 4, 5], 0, [6])])
    # A prefill needs no decode plan; the native path plans the extend once.
    assert calls == (["plan_extend"] if mode == "native" else [])
    calls.clear()
    runner.forward([SequenceInput([6], 3, [6]), SequenceInput([1], 0, [7])])
    assert calls == ["plan_decode"] and runner.model.arch.num_layers == 2


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("float32", "bfloat16"), ("float16", None)])
def test_other_dtypes_stay_close_to_float32(folder, dtype, kv_dtype):
    """A bfloat16 KV cache under float32 weights, and float16 throughout, on every path."""
    reference = ModelRunner(folder, num_blocks=16, block_size=4)
    other = ModelRunner(folder, num_blocks=16, block_size=4, dtype=dtype, kv_dtype=kv_dtype)
    assert other.kv.k.dtype == getattr(torch, kv_dtype or dtype)
    steps = [
        [SequenceInput(list(range(1, 12)), 0, [0, 1, 2]), SequenceInput([5, 6, 7], 0, [3])],
        [SequenceInput([9, 10], 11, [0, 1, 2, 4]), SequenceInput([8], 3, [3])],
    ]
    for batch in steps:
        want = reference.forward(batch).logits
        got = other.forward(batch).logits
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_mixed_kv_dtype_is_refused_on_the_triton_path(folder, monkeypatch):
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    with pytest.raises(ValueError, match="torch kernels only"):
        ModelRunner(folder, num_blocks=4, kv_dtype="bfloat16")
