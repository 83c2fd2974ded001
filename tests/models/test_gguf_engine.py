"""GGUF models served from their blocks: ``Engine("model.gguf")`` keeps Q4_0, Q4_1 and Q8_0
matrices as the file's bytes (nothing converted or cached but the config and tokenizer), and its
outputs stay close to the same model dequantized to float32: greedy outputs agree token for token
until a position where the float model's two likeliest tokens were nearly tied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf

from radixlang.kernels import block_linear as block_kernel
from radixlang.kernels import native_build
from radixlang.kernels.block_formats import RawBlocks
from radixlang.kernels.block_linear import PackedBlocks
from radixlang.runtime.engine import Engine
from radixlang.runtime.models import block_linear as block_linear_layer
from radixlang.runtime.models.block_linear import BlockEmbedding, BlockLinear

PROMPTS = ["hello there", "the cat sat on", "1 2 3 4", "in a far land", "a b c", "where is"]
NEW_TOKENS = 12
# A float32 model's top-2 logprob gap under which int8 activations (0.5% error) may flip the
# greedy choice; above it the quantized model must pick the same token. Measured on these tiny
# models (2 seeds x 3 formats x 10 prompts): flips at gaps up to 0.074, median gap 0.28-0.36.
NEAR_TIE = 0.15


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    if reason := native_build.skip_reason(block_kernel._library):
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, to see what loading writes there."""
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1", "mixed"])
def tiny(request, tmp_path_factory):
    # "mixed": q/k in Q4_0, v in Q8_0 (one fused q/k/v of two formats), the rest Q4_1, as
    # llama.cpp's mixes keep some projections at higher precision.
    types = (
        {"blk.*.attn_v.*": "Q8_0", "blk.*.attn_[qk].*": "Q4_0", "blk.*": "Q4_1"}
        if request.param == "mixed"
        else request.param
    )
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param.lower()}.gguf"
    write_tiny_gguf(path, types=types, embed_type="Q8_0", seed=3, layers=2)
    return path


def greedy(engine: Engine, prompt: str | list[int], top: int = 0) -> object:
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    if top:
        sampling |= {"return_logprob": True, "top_logprobs_num": top}
    return engine.generate(prompt, sampling)


def check_close_to_float(quantized: Engine, reference: Engine, prompts: list) -> int:
    """Each prompt's greedy tokens agree until a near tie of the float model; returns how many
    tokens agreed in all (a figure for the note, not an assertion)."""
    agreed = 0
    for prompt in prompts:
        want = greedy(reference, prompt, top=2)
        got = greedy(quantized, prompt).output_ids
        for i, (a, b) in enumerate(zip(got, want.output_ids, strict=True)):
            if a != b:
                top2 = want.output_top_logprobs[i]
                gap = top2[0][1] - top2[1][1] if len(top2) > 1 else float("inf")
                assert gap < NEAR_TIE, (prompt, i, gap)
                break
            agreed += 1
    return agreed


def test_a_gguf_file_is_served_from_its_blocks(tiny, cache):
    with Engine(str(tiny), dtype="float32", kv_memory="16MiB") as engine:
        info = engine.runner.describe()
        assert info["quantization"] == "gguf"
        layer = engine.runner.model.layers[0]
        assert isinstance(layer.qkv, BlockLinear) and isinstance(layer.down, BlockLinear)
        assert all(f in ("Q8_0", "Q4_0", "Q4_1") for f in layer.qkv.formats + layer.down.formats)
        if "mixed" in tiny.name:
            assert layer.qkv.formats == ["Q4_0", "Q4_0", "Q8_0"]
        # The weights are the file's bytes, repacked (as many bytes).
        down = layer.down.parts[0][2]
        assert isinstance(down, PackedBlocks) and layer.down.packed == [True]
        assert down.num_bytes == down.rows * down.format.row_bytes(down.cols)  # whole groups
        # The Q8_0 token embedding stays blocks too; a lookup dequantizes its rows.
        embed = engine.runner.model.embed
        assert isinstance(embed, BlockEmbedding) and embed.blocks.format.name == "Q8_0"
        ids = torch.tensor([[5, 0], [7, 5]])
        rows = embed(ids)
        assert rows.shape == (2, 2, embed.shape[1]) and torch.equal(rows[0, 0], rows[1, 1])
        assert torch.equal(rows[1, 0], block_kernel.dequantize(embed.blocks)[7])
        assert len(greedy(engine, "hello").output_ids) == NEW_TOKENS
    # Nothing but the config and tokenizer was written to the model cache.
    written = {p.name for p in (cache / "models").rglob("*") if p.is_file()}
    assert "config.json" in written and not [n for n in written if "safetensors" in n]


def test_greedy_outputs_agree_with_the_dequantized_model_up_to_near_ties(tiny):
    with (
        Engine(str(tiny), dtype="float32", kv_memory="16MiB") as quantized,
        Engine(str(tiny), dtype="float32", kv_memory="16MiB", quantization="none") as reference,
    ):
        assert reference.runner.describe()["quantization"] == "none"
        agreed = check_close_to_float(quantized, reference, PROMPTS)
    assert agreed > 0


def test_deterministic_mode_gives_a_prompt_the_same_tokens_alone_and_in_a_batch(tiny):
    with Engine(str(tiny), dtype="float32", kv_memory="16MiB", deterministic=True) as engine:
        alone = [greedy(engine, p).output_ids for p in PROMPTS]
        engine.flush_cache()
        sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        together = [r.output_ids for r in engine.generate(PROMPTS, sampling)]
    assert alone == together


def test_a_q4_k_m_file_is_served_from_its_k_quant_blocks(tmp_path):
    """llama.cpp's Q4_K_M mix (Q4_K, and Q6_K for the output layer and some attn_v / ffn_down):
    a fused q/k/v of two formats, an output layer in Q6_K; close to the model dequantized."""
    # Two layers of 256 wide (the k-quants' super-blocks), typed as llama.cpp's Q4_K_M mix types
    # them (bench_scale.tensor_type): of two layers, the last gets the more bits.
    types = {"output.weight": "Q6_K", "blk.1.attn_v.*": "Q6_K", "blk.1.ffn_down.*": "Q6_K",
             "blk.*": "Q4_K", "token_embd.weight": "Q4_K"}  # fmt: skip
    path = write_tiny_gguf(tmp_path / "tiny-k.gguf", types=types, hidden=256, intermediate=512,
                           tie_embeddings=False, seed=2).path  # fmt: skip
    with (
        Engine(str(path), dtype="float32", kv_memory="16MiB") as quantized,
        Engine(str(path), dtype="float32", kv_memory="16MiB", quantization="none") as reference,
    ):
        model = quantized.runner.model
        # Of two layers, the last gets the more bits: Q6_K for its attn_v and ffn_down.
        assert model.layers[0].qkv.formats == ["Q4_K"] * 3
        assert model.layers[1].qkv.formats == ["Q4_K", "Q4_K", "Q6_K"]
        assert model.layers[1].down.formats == ["Q6_K"] and model.layers[1].o.formats == ["Q4_K"]
        assert isinstance(model.lm_head, BlockLinear) and model.lm_head.formats == ["Q6_K"]
        assert check_close_to_float(quantized, reference, PROMPTS) > 0


def test_a_quantized_embedding_beside_a_float_output_layer(tmp_path):
    """Untied: the token embedding stays Q8_0 blocks, the F16 output layer a float linear."""
    from radixlang.model_files import gguf_config
    from radixlang.runtime.models.llama import LlamaForCausalLM

    types = {"output.weight": "F16", "blk.*": "Q4_0"}
    path = write_tiny_gguf(tmp_path / "untied.gguf", types=types, embed_type="Q8_0",
                           tie_embeddings=False).path  # fmt: skip
    model = LlamaForCausalLM.from_gguf(path, gguf_config(path))
    assert isinstance(model.embed, BlockEmbedding)
    assert not isinstance(model.lm_head, BlockLinear)
    assert model.layers[0].gate_up.formats == ["Q4_0", "Q4_0"]


def test_quantization_gguf_needs_a_gguf_model(tmp_path):
    from tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match="GGUF"):
        Engine(str(folder), quantization="gguf", kv_memory="16MiB")


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_a_float_model_quantized_at_load_runs_as_llama_cpps_file_of_it(quantization, tmp_path):
    """Quantizing at load makes llama.cpp's blocks bit for bit, so a float model quantized at
    load and the GGUF file llama.cpp's quantizer made of the same weights give the same tokens
    and the same logprobs."""
    fmt = quantization.upper()
    floats = write_tiny_gguf(tmp_path / "f32.gguf", types="F32", seed=7).path
    quantized_file = write_tiny_gguf(tmp_path / f"{quantization}.gguf", types=fmt, seed=7).path
    with (
        Engine(str(floats), dtype="float32", kv_memory="16MiB", quantization=quantization) as a,
        Engine(str(quantized_file), dtype="float32", kv_memory="16MiB") as b,
    ):
        layer = a.runner.model.layers[0]
        assert layer.gate_up.formats == [fmt, fmt]
        assert a.runner.describe()["weights_bytes"] == b.runner.describe()["weights_bytes"]
        for prompt in PROMPTS:
            want, got = greedy(b, prompt, top=2), greedy(a, prompt, top=2)
            assert got.output_ids == want.output_ids
            assert got.output_logprobs == want.output_logprobs


# ---- BlockLinear --------------------------------------------------------------------------


def blocks_of(weight: torch.Tensor, name: str) -> RawBlocks:
    from gguf import GGMLQuantizationType, quants

    from radixlang.kernels.block_formats import FORMATS

    data = quants.quantize(weight.numpy(), GGMLQuantizationType[name])
    return RawBlocks(FORMATS[name], weight.shape[0], weight.shape[1], data)


def test_a_fused_linear_writes_each_part_into_its_columns():
    gen = torch.Generator().manual_seed(1)
    q = blocks_of(torch.randn(32, 64, generator=gen), "Q4_0")
    v = blocks_of(torch.randn(16, 64, generator=gen), "Q8_0")
    dense = torch.randn(8, 64, generator=gen)
    fused = BlockLinear([q, v, dense], bias=torch.arange(56, dtype=torch.float32))
    x = torch.randn(3, 64, generator=gen)
    got = fused(x)
    parts = []
    for part in (q, v):
        out = torch.empty(3, part.rows)
        block_kernel.linear_into(x, part, out)
        parts.append(out)
    parts.append(x @ dense.T)
    assert torch.allclose(got, torch.cat(parts, dim=1) + torch.arange(56), atol=1e-5)
    assert fused.formats == ["Q4_0", "Q8_0", "float"]
    assert fused.num_bytes == q.num_bytes + v.num_bytes + dense.numel() * 4 + 56 * 4


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_batches_take_the_gemm_only_in_bfloat16_on_amx(dtype, amx, monkeypatch):
    """Prefill-sized batches take the packed kernel (rows as in any batch), except bfloat16 on a
    CPU with AMX tiles: a GEMM on the dequantized weight, exactly F.linear's result."""
    monkeypatch.setattr(block_linear_layer, "amx_tiles", lambda: amx)
    gen = torch.Generator().manual_seed(2)
    blocks = blocks_of(torch.randn(40, 96, generator=gen), "Q4_1")
    x = torch.randn(block_kernel.GEMM_MIN_ROWS + 3, 96, generator=gen).to(dtype)
    layer = BlockLinear([blocks], dtype=dtype)
    assert layer.packed == [True]
    got = layer(x)
    want = torch.nn.functional.linear(x, block_kernel.dequantize(blocks, dtype))
    assert got.dtype == dtype
    if amx and dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.equal(got[:2], layer(x[:2]))  # the kernel: rows independent of the batch
        assert not torch.equal(got, want)  # and not the GEMM (the int8 activations differ)
    # Deterministic mode keeps the block kernel at every size.
    invariant = BlockLinear([blocks], dtype=dtype, deterministic=True)
    assert torch.equal(invariant(x)[:2], invariant(x[:2]))


def test_the_block_data_the_model_holds_is_not_copied_per_call():
    """The kernel reads the blocks where they are (np arrays are passed by pointer)."""
    gen = torch.Generator().manual_seed(4)
    blocks = blocks_of(torch.randn(8, 32, generator=gen), "Q8_0")
    before = blocks.data.copy()
    BlockLinear([blocks])(torch.randn(2, 32, generator=gen))
    assert np.array_equal(blocks.data, before)
