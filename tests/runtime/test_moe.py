"""Mixture-of-experts layers (models/moe.py) beyond parity with transformers (which
test_model_parity.py checks): only the routed experts run, on only their tokens' rows; which
layers are sparse; both checkpoint layouts of the experts; quantized experts; deterministic
mode's batch invariance."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from tiny_models import cpu_has, make_tiny_model, random_model, tiny_config

from radixlang.kernels import block_linear as block_kernel
from radixlang.kernels import invariant_linear, native_linear
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.models.block_linear import BlockLinear
from radixlang.runtime.models.linear import Int8Linear, InvariantLinear, onednn_linear_available
from radixlang.runtime.models.llama import LlamaArch
from radixlang.runtime.models.moe import SparseMLP

VOCAB = 160


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {kind: make_tiny_model(kind, root / kind, seed=7) for kind in ("qwen3_moe", "mixtral")}


def prompts(lens: list[int], salt: int = 0) -> list[list[int]]:
    return [[(11 * i + 5 * j + salt) % VOCAB for j in range(n)] for i, n in enumerate(lens)]


def tables(lens: list[int], width: int = 8) -> list[list[int]]:
    return [[i * width + j for j in range(width)] for i in range(len(lens))]


def prefills(lens: list[int]) -> list[SequenceInput]:
    """Whole prompts of these lengths, each in its own 8 blocks."""
    return [SequenceInput(p, 0, t) for p, t in zip(prompts(lens), tables(lens), strict=True)]


class Recorder:
    """Wraps each sparse layer's router and experts: the experts each token was routed to, and
    the rows each expert was called on."""

    def __init__(self, moe: SparseMLP) -> None:
        self.routed: list[torch.Tensor] = []
        self.rows: dict[int, list[int]] = defaultdict(list)
        route = moe.route

        def recording_route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = route(x)
            self.routed.append(ids)
            return weights, ids

        moe.route = recording_route  # type: ignore[method-assign]
        for e, expert in enumerate(moe.experts):
            expert.gate_up = self._counting(e, expert.gate_up)

    def _counting(self, e: int, linear):  # type: ignore[no-untyped-def]
        def call(x: torch.Tensor) -> torch.Tensor:
            self.rows[e].append(x.shape[0])
            return linear(x)

        return call


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_only_the_routed_experts_run_on_only_their_tokens(folders, kind):
    runner = ModelRunner(folders[kind], num_blocks=64, block_size=4)
    arch = runner.model.arch
    recorders = {i: Recorder(layer.moe) for i, layer in enumerate(runner.model.layers) if layer.moe}
    assert sorted(recorders) == list(arch.moe_layers)
    lens = [13, 6, 9]
    runner.forward(prefills(lens))
    for i, rec in recorders.items():
        (ids,) = rec.routed
        assert ids.shape == (sum(lens), arch.experts_per_token)
        counts = torch.bincount(ids.reshape(-1), minlength=arch.num_experts).tolist()
        # Each expert once, on exactly the rows routed to it; unrouted experts never.
        assert dict(rec.rows) == {e: [n] for e, n in enumerate(counts) if n}, f"layer {i}"
        assert sum(n > 0 for n in counts) > arch.experts_per_token  # tokens route apart
        rec.routed.clear()
        rec.rows.clear()
    # One decode token: exactly k experts, one row each.
    runner.forward([SequenceInput([3], lens[0], tables(lens)[0])])
    for rec in recorders.values():
        (ids,) = rec.routed
        assert sorted(rec.rows) == sorted(ids[0].tolist())
        assert all(rows == [1] for rows in rec.rows.values())


def test_the_sparse_mlp_is_the_dense_sum_of_its_routed_experts(folders):
    """Against every expert run on every token, weighted by the router's top-k (zero elsewhere):
    the grouping and scatter put each output back on its token."""
    runner = ModelRunner(folders["qwen3_moe"], num_blocks=8, block_size=4)
    moe = runner.model.layers[1].moe
    torch.manual_seed(0)
    x = torch.randn(23, runner.model.arch.hidden_size)
    weights, ids = moe.route(x)
    want = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        gate, up = expert.gate_up(x).chunk(2, dim=-1)
        out = expert.down(torch.nn.functional.silu(gate) * up)
        w = (weights * (ids == e)).sum(-1, keepdim=True)
        want += w * out
    torch.testing.assert_close(moe(x, torch.nn.functional.silu), want, atol=1e-5, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(23))  # norm_topk_prob


def test_which_layers_are_sparse_is_transformers():
    from transformers import AutoModelForCausalLM

    config = tiny_config(
        "qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    arch = LlamaArch.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(arch.moe_layers) == sparse == [1, 5]
    mixtral = LlamaArch.from_config(tiny_config("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob
    assert mixtral.layer_windows == (7, 7) and mixtral.expert_intermediate_size == 96


def test_fused_expert_tensors_load_as_per_expert_ones(folders, tmp_path):
    """transformers 5 holds the experts as 3-D ``mlp.experts.gate_up_proj``/``down_proj`` (its
    save_pretrained writes them apart, as released checkpoints do); a folder of the fused
    tensors, Mixtral's under ``mlp.``, gives the same logits."""
    from safetensors.torch import save_file

    for kind, folder in folders.items():
        model = random_model(tiny_config(kind), seed=7)
        state = model.state_dict()
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
        fused = tmp_path / kind
        fused.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
        (fused / "config.json").write_text(json.dumps(model.config.to_dict()))
        lens = [10, 3]
        seqs = prefills(lens)
        want = ModelRunner(folder, num_blocks=16, block_size=4).forward(seqs).logits
        got = ModelRunner(fused, num_blocks=16, block_size=4).forward(seqs).logits
        assert torch.equal(got, want), kind


@pytest.mark.parametrize("quantization", ["int8", "q8_0"])
def test_quantized_experts_stay_close_to_float(tmp_path, quantization):
    if quantization == "int8" and not native_linear.available():
        pytest.skip("the native int8 kernel did not build")
    if quantization == "q8_0" and not block_kernel.available():
        pytest.skip("the native block kernel did not build")
    # Experts 64 wide: rows that split into 32-element blocks.
    folder = make_tiny_model("qwen3_moe", tmp_path / "q", moe_intermediate_size=64)
    lens = [17, 5]
    seqs = prefills(lens)
    want = ModelRunner(folder, num_blocks=16, block_size=4).forward(seqs).logits
    runner = ModelRunner(folder, num_blocks=16, block_size=4, quantization=quantization)
    moe = runner.model.layers[1].moe
    held = Int8Linear if quantization == "int8" else BlockLinear
    assert all(isinstance(e.gate_up, held) and isinstance(e.down, held) for e in moe.experts)
    assert not isinstance(moe.router, held)  # the router stays float
    got = runner.forward(seqs).logits
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


# Experts 1,536 wide: oneDNN runs a few rows of that width another way than many, so an expert
# path that ignored the mode would give a token other bits beside other tokens (the contrast test
# shows it does).
WIDE = {"qwen3_moe": {"moe_intermediate_size": 1536}, "mixtral": {"intermediate_size": 1536}}


@pytest.fixture(scope="module")
def wide_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-wide")
    shape = {"hidden_size": 96, "num_attention_heads": 6, "head_dim": 16}
    return {
        kind: make_tiny_model(kind, root / kind, seed=3, **shape, **WIDE[kind]) for kind in WIDE
    }


def invariance_failures(runner: ModelRunner) -> list[str]:
    """Where a token's logits differ alone and in a batch (so each expert runs on other row
    counts): decodes alone against all of them together; the last token of an extend alone and
    beside other extends and decodes against its decode."""
    lens = [14, 23, 5, 19, 9]
    ps, ts = prompts(lens), tables(lens)
    runner.forward(prefills(lens))

    def decode(rows):  # type: ignore[no-untyped-def]
        return runner.forward([SequenceInput([5], lens[i], ts[i]) for i in rows]).logits

    batched = decode(range(len(lens)))
    failures = [
        f"decode {i}" for i in range(len(lens)) if not torch.equal(decode([i])[0], batched[i])
    ]
    spare = len(lens) * 8
    whole = ps[0] + [5]
    alone = runner.forward([SequenceInput(whole, 0, list(range(spare, spare + 8)))]).logits[0]
    if not torch.equal(alone, batched[0]):
        failures.append("extend alone")
    beside = runner.forward(
        [SequenceInput(whole, 0, list(range(spare + 8, spare + 16)))]
        + [SequenceInput(p, 0, list(range(spare + 16 + 8 * i, spare + 24 + 8 * i)))
           for i, p in enumerate(prompts([30, 7], salt=3))]
        + [SequenceInput([9], lens[i], ts[i]) for i in range(1, len(lens))]
    ).logits  # fmt: skip
    if not torch.equal(beside[0], batched[0]):
        failures.append("extend in a batch")
    return failures


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_logits_are_the_same_bits_alone_and_in_a_batch(wide_folders, kind, dtype):
    runner = ModelRunner(
        wide_folders[kind], dtype=dtype, num_blocks=96, block_size=4, deterministic=True
    )
    moe = runner.model.layers[-1].moe
    if invariant_linear.available():
        assert all(isinstance(e.gate_up, InvariantLinear) for e in moe.experts)
        assert isinstance(moe.router, InvariantLinear)
    assert invariance_failures(runner) == []


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_experts_outside_the_mode_would_break_it(wide_folders, kind):
    """The check above catches an expert path that ignores the mode: the deterministic runner
    with its experts' linears swapped for the ordinary (oneDNN) ones fails it in float32."""
    if not invariant_linear.available() or not onednn_linear_available(torch.float32):
        pytest.skip("needs the native invariant linear and oneDNN")
    if not cpu_has("avx512f"):
        # Seen on a 2-core AVX2-only EPYC: oneDNN gave the same bits at these shapes whatever
        # the batch, so there is nothing to contrast there (the check itself runs above).
        pytest.skip("oneDNN's float32 results vary with the batch only on AVX-512 CPUs here")
    runner = ModelRunner(wide_folders[kind], num_blocks=96, block_size=4, deterministic=True)
    plain = ModelRunner(wide_folders[kind], num_blocks=8, block_size=4)
    for layer, ordinary in zip(runner.model.layers, plain.model.layers, strict=True):
        if layer.moe is not None:
            layer.moe.experts = ordinary.moe.experts
    assert invariance_failures(runner) != []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_on_a_gpu_deterministic_moe_is_batch_invariant_and_graphs_stay_off(folders, kind):
    runner = ModelRunner(
        folders[kind], device="cuda", num_blocks=96, block_size=4, deterministic=True
    )
    assert not runner.cuda_graphs
    assert invariance_failures(runner) == []
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelRunner(folders[kind], device="cuda", num_blocks=8, cuda_graphs=True)
