"""Qwen3-MoE and Mixtral GGUF files, written as llama.cpp's converter writes them
(tests/gguf_files.py: each layer's router an F32 ``ffn_gate_inp``, its experts the 3-D
``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps``; Mixtral as "llama" with
``llama.expert_count``): the config read from their metadata, their tensors under Hugging Face
names with each expert a slice of the file, an F32 file run against transformers on the model it
was made from, and Q8_0/Q4_0 files served from their blocks, each expert its own block linear,
close to the same model dequantized."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf
from test_gguf_archs import metadata_file
from test_gguf_engine import NEAR_TIE, NEW_TOKENS
from tiny_models import reference_greedy, stepped_engine

from radixlang.gguf_file import GGUFFile
from radixlang.kernels import block_linear as block_kernel
from radixlang.kernels import native_build
from radixlang.model_files import UnsupportedModelError, _gguf_config_dict, gguf_config
from radixlang.runtime.engine import Engine
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.models.block_linear import BlockLinear
from radixlang.runtime.models.gguf_weights import GGUFWeights
from radixlang.runtime.models.llama import LlamaArch
from radixlang.runtime.models.moe import SparseMLP

KINDS = ("qwen3_moe", "mixtral")
QUANTIZED = ("Q8_0", "Q4_0")
ATOL = 2e-4
VOCAB = 271  # the bytes tokenizer's (gguf_files.BYTES_VOCAB)
EXPERTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, to see what loading writes there."""
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A kind's file in a type (its 2-D and expert weights; the token embedding Q8_0 with
    quantized layers), written once per module."""
    folder = tmp_path_factory.mktemp("gguf-moe")
    made = {}

    def get(kind: str, types: str = "F32"):
        if (kind, types) not in made:
            embed = "F32" if types == "F32" else "Q8_0"
            path = folder / f"{kind}-{types.lower()}.gguf"
            made[kind, types] = write_tiny_gguf(
                path, arch=kind, types=types, embed_type=embed, seed=KINDS.index(kind) + 11
            )
        return made[kind, types]

    return get


def needs_native_kernel() -> None:
    if reason := native_build.skip_reason(block_kernel._library):
        pytest.skip(reason)


def reference_model(made):
    """transformers' model of the weights the file was made from, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        made.config, dtype=torch.float32, attn_implementation="eager"
    )
    model.load_state_dict(made.state_dict)
    return model.eval()


def prompts(kind: str, count: int, seed: int = 0) -> list[list[int]]:
    """Token prompts of 16 to 39 tokens."""
    rng = random.Random(f"{kind}-{seed}")
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 40))] for _ in range(count)]


def source_tensor(made, name: str) -> torch.Tensor:
    """The model's own tensor of a file's name: an expert gate or up tensor is its half of
    transformers 5's fused ``gate_up_proj``."""
    stem, _, which = name.rpartition(".")
    if ".mlp.experts." in name and which in ("gate_proj", "up_proj"):
        gate, up = made.state_dict[f"{stem}.gate_up_proj"].chunk(2, dim=1)
        return gate if which == "gate_proj" else up
    return made.state_dict[name]


# ---- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_config_read_from_the_metadata_is_the_models(tiny, kind):
    """Every architecture fact the runner reads, as the model's own config gives it: every
    layer sparse, the experts' count, width and top-k, renormalised (eps as float32 holds it)."""
    made = tiny(kind)
    config = gguf_config(made.path)
    assert config.model_type == made.config.model_type
    got, want = LlamaArch.from_config(config), LlamaArch.from_config(made.config)
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert got.moe_layers == (0, 1) and got.num_experts == 4 and got.experts_per_token == 2
    assert got.norm_topk_prob and got.layer_windows == ()
    assert got.expert_intermediate_size == (64 if kind == "qwen3_moe" else 128)


EXPERT_KEYS = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32}


def routers(*layers: int) -> dict[str, np.ndarray]:
    return {f"blk.{i}.ffn_gate_inp.weight": np.zeros((4, 64), np.float32) for i in layers}


def test_qwen3moe_routing_and_dense_layers_as_the_metadata_says(tmp_path):
    keys = EXPERT_KEYS | {"block_count": 3}
    config = gguf_config(metadata_file(tmp_path / "a.gguf", "qwen3moe", keys, routers(0, 1, 2)))
    assert config.model_type == "qwen3_moe" and config.mlp_only_layers == []
    # llama.cpp's qwen3moe always renormalises; a file may say otherwise.
    assert config.norm_topk_prob and config.moe_intermediate_size == 32
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    off = keys | {"expert_weights_norm": False}
    path = metadata_file(tmp_path / "b.gguf", "qwen3moe", off, routers(0, 1, 2))
    assert not gguf_config(path).norm_topk_prob
    # A layer without a router is a dense one (as a leading dense block would be).
    config = gguf_config(metadata_file(tmp_path / "c.gguf", "qwen3moe", keys, routers(1, 2)))
    assert config.mlp_only_layers == [0]
    assert LlamaArch.from_config(config).moe_layers == (1, 2)


@pytest.mark.parametrize(
    ("arch", "keys", "tensors", "match"),
    [
        ("qwen3moe", {"expert_gating_func": 2}, routers(*range(8)), "gating"),  # sigmoid
        ("qwen3moe", {"expert_shared_count": 1}, routers(*range(8)), "shared"),
        ("qwen3moe", {"expert_used_count": 5}, routers(*range(8)), "experts per token"),
        ("qwen3moe", {"expert_weights_scale": 2.5}, routers(*range(8)), "scaled"),
        ("qwen3moe", {}, {}, "no layer has a router"),
        ("llama", {}, routers(*range(1, 8)), "no router"),  # Mixtral: every layer sparse
    ],
)
def test_routing_computed_otherwise_is_refused(tmp_path, arch, keys, tensors, match):
    path = metadata_file(tmp_path / "r.gguf", arch, EXPERT_KEYS | keys, tensors)
    with pytest.raises(UnsupportedModelError, match=match):
        _gguf_config_dict(GGUFFile(path))


def test_a_llama_file_with_experts_is_mixtral(tmp_path):
    config = gguf_config(
        metadata_file(tmp_path / "m.gguf", "llama", EXPERT_KEYS, routers(*range(8)))
    )
    assert config.model_type == "mixtral" and config.num_local_experts == 4
    assert config.intermediate_size == 32  # the experts' width where stated
    assert config.sliding_window is None  # llama.cpp's llama attends fully
    plain = gguf_config(metadata_file(tmp_path / "l.gguf", "llama", {}))
    assert plain.model_type == "llama"


# ---- the tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("types", ["F32", "Q8_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_expert_tensors_are_the_models_each_expert_a_slice_of_the_file(tiny, kind, types):
    """Every tensor under the model's names (experts 3-D, ``[experts, out, in]``; the router
    ``mlp.gate``), none left unread; an expert's matrix and blocks are its slice of the file's
    3-D tensor, read in place."""
    made = tiny(kind, types)
    weights = GGUFWeights(made.path)
    assert weights.ignored == ()
    layer = "model.layers.1.mlp."
    names = [f"{layer}experts.{w}" for w in EXPERTS]
    assert {layer + "gate.weight", *names} <= set(weights.names)
    width = LlamaArch.from_config(made.config).expert_intermediate_size
    assert [weights.shape_of(n) for n in names] == [(4, width, 64)] * 2 + [(4, 64, width)]
    assert weights.format_of(layer + "gate.weight") == "F32"  # routers stay float
    for name in names:
        whole = weights.get(name)
        if types == "F32":
            assert torch.equal(whole, source_tensor(made, name))
        else:
            torch.testing.assert_close(whole, source_tensor(made, name), atol=0.01, rtol=0)
        for e in range(4):
            assert torch.equal(weights.get(name, expert=e), whole[e])
        if types != "F32":
            assert weights.format_of(name) == types
            blocks = weights.blocks(name, expert=3)
            assert (blocks.rows, blocks.cols) == weights.shape_of(name)[1:]
            assert np.shares_memory(blocks.data, weights.file.mapped)  # not a copy
            assert torch.equal(block_kernel.dequantize(blocks), whole[3])
    for name in weights.names:
        if ".experts." not in name and types == "F32":
            assert torch.equal(weights.get(name), made.state_dict[name]), name
    with pytest.raises(UnsupportedModelError, match="no expert 4"):
        weights.blocks(names[0], expert=4)


def test_qwen3moe_tensors_are_transformers_loading(tiny):
    """transformers reads qwen3moe files (not Mixtral ones): its fused experts are ours."""
    from transformers import AutoModelForCausalLM

    made = tiny("qwen3_moe", "Q8_0")
    weights = GGUFWeights(made.path)
    model = AutoModelForCausalLM.from_pretrained(
        made.path.parent,
        gguf_file=made.path.name,
        config=weights.hf_config(),
        dtype=torch.float32,
        local_files_only=True,
    )
    reference = model.state_dict()
    for name in weights.names:
        stem, _, which = name.rpartition(".")
        if stem.endswith("mlp.experts") and which != "down_proj":
            gate, up = reference[f"{stem}.gate_up_proj"].chunk(2, dim=1)
            want = gate if which == "gate_proj" else up
        else:
            want = reference[name]
        assert torch.equal(weights.get(name), want), name


# ---- an F32 file against transformers -----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_f32_file_runs_as_transformers_runs_its_model(tiny, kind):
    """Prefill, a cached prefix then the rest, and token-by-token decode: the logits within
    2e-4 of transformers' on the Hugging Face weights the file was made from."""
    made = tiny(kind)
    runner = ModelRunner(str(made.path), num_blocks=64, block_size=4)
    assert runner.describe()["quantization"] == "gguf"
    assert runner.model.arch.model_type == made.config.model_type
    model = reference_model(made)
    blocks = iter(range(64))
    split = 10
    for ids in prompts(kind, 3):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        table = [next(blocks) for _ in range(-(-len(ids) // 4))]
        out = runner.forward([SequenceInput(ids[:split], 0, table, return_logprobs=True)])
        torch.testing.assert_close(out.logits[0], want[split - 1], atol=ATOL, rtol=0)
        logprobs = torch.log_softmax(want[: split - 1], -1)
        gathered = logprobs.gather(1, torch.tensor(ids[1:split])[:, None]).squeeze(1)
        torch.testing.assert_close(out.prompt_logprobs[0], gathered, atol=ATOL, rtol=0)
        rest = runner.forward([SequenceInput(ids[split:-4], split, table)])
        torch.testing.assert_close(rest.logits[0], want[-5], atol=ATOL, rtol=0)
        for pos in range(len(ids) - 4, len(ids)):
            step = runner.forward([SequenceInput(ids[pos : pos + 1], pos, table)])
            torch.testing.assert_close(step.logits[0], want[pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_an_f32_file_gives_transformers_greedy_tokens(tiny, kind):
    made = tiny(kind)
    batch = prompts(kind, 6, seed=1)
    model = reference_model(made)
    want = [reference_greedy(model, p, 10) for p in batch]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
    engine = stepped_engine(str(made.path))
    assert [r.output_ids for r in engine.generate(batch, [greedy] * len(batch))] == want
    engine.check_integrity()


# ---- quantized files ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_file_is_served_from_its_blocks(tiny, kind, fmt, cache):
    """Every sparse layer a SparseMLP of the file's expert count and top-k; each expert's
    gate/up and down block linears of its own slices (packed), the router float; nothing
    written to the cache but the config and tokenizer."""
    needs_native_kernel()
    made = tiny(kind, fmt)
    with Engine(str(made.path), dtype="float32", kv_memory="16MiB") as engine:
        model = engine.runner.model
        assert engine.runner.describe()["quantization"] == "gguf"
        for layer in model.layers:
            moe = layer.moe
            assert isinstance(moe, SparseMLP) and layer.gate_up is None and layer.down is None
            assert len(moe.experts) == 4 and moe.top_k == 2 and moe.normalize
            assert not isinstance(moe.router, BlockLinear)
            for expert in moe.experts:
                assert isinstance(expert.gate_up, BlockLinear)
                assert isinstance(expert.down, BlockLinear)
                assert expert.gate_up.formats == [fmt, fmt] and expert.down.formats == [fmt]
                assert expert.gate_up.packed == [True, True] and expert.down.packed == [True]
            assert isinstance(layer.qkv, BlockLinear) and layer.qkv.formats == [fmt] * 3
        # Two experts' gate/up of one layer are different slices, as the file holds them.
        weights = GGUFWeights(made.path)
        first = model.layers[1].moe.experts
        x = torch.randn(3, 64)
        for e in (0, 3):
            gate = weights.get("model.layers.1.mlp.experts.gate_proj", expert=e)
            got = first[e].gate_up(x)[:, : gate.shape[0]]
            assert (got - x @ gate.T).abs().max() < 0.05 * (x @ gate.T).abs().max()
        sampling = {"max_new_tokens": 4, "ignore_eos": True}
        assert len(engine.generate("hello", sampling).output_ids) == 4
    written = {p.name for p in (cache / "models").rglob("*") if p.is_file()}
    assert "config.json" in written and not [n for n in written if "safetensors" in n]


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("kind", KINDS)
def test_the_blocks_are_the_models_weights(tiny, kind, fmt, monkeypatch):
    """With each block linear multiplying by its blocks dequantized (no int8 activations), the
    file served from its blocks is the file converted to float32 (quantization="none") to
    float rounding: every expert slice is the expert's own matrix, in its place."""
    needs_native_kernel()
    path = str(tiny(kind, fmt).path)
    quantized = ModelRunner(path, num_blocks=16)
    reference = ModelRunner(path, num_blocks=16, quantization="none")
    monkeypatch.setattr(BlockLinear, "_block_dots", BlockLinear._dequantized_gemm)
    for ids in prompts(kind, 3, seed=4):
        got, want = (
            r.forward([SequenceInput(ids, 0, list(range(4)))]).logits[0]
            for r in (quantized, reference)
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# The quantized runner's largest logit error against the dequantized model, as a fraction of
# the logits' standard deviation (as in test_gguf_archs): int8 activations are the only
# difference, measured 0.05-0.11 on these files; a misread expert gives errors of the logits'
# own size. Where those small errors move a token (of this prompt, or one it attends to) across
# a top-k tie of some layer's router, that token takes another expert: measured up to 0.26.
LOGIT_ERROR = 0.25
LOGIT_ERROR_REROUTED = 0.5


def record_routes(runner: ModelRunner) -> list[torch.Tensor]:
    """Each sparse layer's chosen experts (sorted per token) of the runner's forwards, appended
    in call order to the returned list."""
    routes: list[torch.Tensor] = []
    for layer in runner.model.layers:
        route = layer.moe.route

        def recording(x: torch.Tensor, route=route) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = route(x)
            routes.append(ids.sort(dim=-1).values)
            return weights, ids

        layer.moe.route = recording
    return routes


def greedy_in_lockstep(runners: list[ModelRunner], routes: list[list], ids: list[int]) -> int:
    """Greedy decoding of ``ids`` by the quantized and the float runner side by side, each fed
    the same tokens: they agree until the float model's top two are a near tie, or some token
    so far took other experts in one of them; returns how many tokens agreed."""
    table = list(range(4))  # 64 positions in blocks of 16
    pos, step, rerouted = 0, ids, False
    for agreed in range(NEW_TOKENS):
        for r in routes:
            r.clear()
        got, want = (r.forward([SequenceInput(step, pos, table)]).logits[0] for r in runners)
        rerouted |= any(not torch.equal(a, b) for a, b in zip(*routes, strict=True))
        if got.argmax() != want.argmax():
            top2 = torch.log_softmax(want, -1).topk(2).values
            assert rerouted or top2[0] - top2[1] < NEAR_TIE, (ids, agreed)
            return agreed
        pos, step = pos + len(step), [int(want.argmax())]
    return NEW_TOKENS


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_file_is_close_to_the_model_dequantized(tiny, kind, fmt):
    """Against the same file converted to float32 (quantization="none": transformers'
    dequantizing for Qwen3-MoE, GGUFWeights' for Mixtral, then the float runner): logits
    within LOGIT_ERROR (LOGIT_ERROR_REROUTED where some token took other experts), greedy
    tokens the same until a near tie of the float model or a token routed otherwise."""
    needs_native_kernel()
    path = str(tiny(kind, fmt).path)
    runners = [
        ModelRunner(path, num_blocks=16),
        ModelRunner(path, num_blocks=16, quantization="none"),
    ]
    assert [r.describe()["quantization"] for r in runners] == ["gguf", "none"]
    assert isinstance(runners[1].model.layers[0].moe, SparseMLP)
    routes = [record_routes(r) for r in runners]
    for ids in prompts(kind, 3, seed=2):
        for r in routes:
            r.clear()
        got, want = (r.forward([SequenceInput(ids, 0, list(range(4)))]).logits[0] for r in runners)
        rerouted = any(not torch.equal(a, b) for a, b in zip(*routes, strict=True))
        bound = LOGIT_ERROR_REROUTED if rerouted else LOGIT_ERROR
        assert (got - want).abs().max() < bound * want.std()
    agreed = [greedy_in_lockstep(runners, routes, ids) for ids in prompts(kind, 6, seed=3)]
    assert sum(agreed) > 0
