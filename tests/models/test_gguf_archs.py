"""Phi-3 and Gemma 3 GGUF files, written as llama.cpp's converter writes them (tests/gguf_files.py):
the config built from their metadata (transformers' own reading drops LongRoPE, partial rotary
and the window of Phi-3, and Gemma 3's local rope base, scaling and logit cap), their tensors
under Hugging Face names (Phi-3's fused qkv/gate_up, Gemma 3's norms stored as ``1 + w``), an
F32 file run against transformers on the model it was made from, and Q8_0/Q4_0 files served
from their blocks, close to the same model dequantized."""

from __future__ import annotations

import dataclasses
import random

import gguf
import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf
from test_gguf_engine import PROMPTS, check_close_to_float
from tiny_models import LONGROPE_ORIGINAL, reference_greedy, stepped_engine

from radixlang.gguf_file import GGUFFile
from radixlang.kernels import block_linear as block_kernel
from radixlang.kernels import native_build
from radixlang.model_files import UnsupportedModelError, _gguf_config_dict, gguf_config
from radixlang.runtime.engine import Engine
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.models.block_linear import BlockEmbedding, BlockLinear
from radixlang.runtime.models.gguf_weights import GGUFWeights
from radixlang.runtime.models.llama import LlamaArch
from radixlang.runtime.models.rope import attention_scaling, inverse_frequencies

KINDS = ("phi3", "phi3_longrope", "gemma3")
QUANTIZED = ("Q8_0", "Q4_0")
ATOL = 2e-4
VOCAB = 271  # the bytes tokenizer's (gguf_files.BYTES_VOCAB)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, to see what loading writes there."""
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A kind's file in a type (its 2-D weights; the token embedding Q8_0 with quantized
    layers), written once per module."""
    folder = tmp_path_factory.mktemp("gguf-archs")
    made = {}

    def get(kind: str, types: str = "F32"):
        if (kind, types) not in made:
            embed = "F32" if types == "F32" else "Q8_0"
            path = folder / f"{kind}-{types.lower()}.gguf"
            made[kind, types] = write_tiny_gguf(
                path, arch=kind, types=types, embed_type=embed, seed=KINDS.index(kind) + 1
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
    """Token prompts (16 to 39) longer than phi3_longrope's original context (transformers then
    runs the long factors from the first token, as the runner always does; see models/rope.py)
    and than the windows of phi3 (10) and gemma3 (6)."""
    rng = random.Random(f"{kind}-{seed}")
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 40))] for _ in range(count)]


# ---- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_config_read_from_the_metadata_is_the_models(tiny, kind):
    """Every architecture fact the runner reads, as the model's own config gives it (floats as
    the file's float32 holds them)."""
    made = tiny(kind)
    got, want = LlamaArch.from_config(gguf_config(made.path)), LlamaArch.from_config(made.config)
    rope = want.rope_parameters
    same = dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps, rope_parameters=rope)
    assert same == want
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    dim, context = want.rotary_dim or want.head_dim, want.max_context
    torch.testing.assert_close(
        inverse_frequencies(dim, got.rope_parameters, context),
        inverse_frequencies(dim, rope, context),
    )
    assert attention_scaling(got.rope_parameters, context) == pytest.approx(
        attention_scaling(rope, context)
    )
    if kind == "phi3":
        assert got.layer_windows == (10, 10) and got.rotary_dim == 16
    elif kind == "phi3_longrope":
        assert got.rope_parameters["rope_type"] == "longrope" and got.rotary_dim == 12
        assert got.layer_windows == () and not got.tie_word_embeddings
    else:
        # Every 6th layer global (llama.cpp's pattern), with the global rope linearly scaled
        # and the local one at its own base; the final logit cap.
        assert got.layer_windows == (6,) * 5 + (None, 6)
        assert got.rope_parameters["rope_type"] == "linear"
        assert got.rope_parameters["factor"] == 2.0
        assert got.local_rope_parameters["rope_theta"] == 1e4
        assert got.final_logit_softcap == 10.0 and got.attn_scale == 16**-0.5
        assert got.norm_offset == 1.0 and got.tie_word_embeddings


def metadata_file(path, arch: str, keys: dict, tensors: dict | None = None, eot: int = 0):
    """A GGUF file of the given metadata (with a small model's common keys) and tensors; its
    end of sequence token 1, and ``eot`` as its end of turn."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_eos_token_id(1)
    if eot:
        writer.add_eot_token_id(eot)
    common = {"context_length": 512, "embedding_length": 64, "block_count": 8,
              "feed_forward_length": 128, "attention.head_count": 4,
              "attention.head_count_kv": 2, "vocab_size": 100}  # fmt: skip
    for key, value in (common | keys).items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(data, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


G, L = "sliding_attention", "full_attention"


@pytest.mark.parametrize(
    ("keys", "layer_types", "window"),
    [
        ({"attention.sliding_window": 16}, [G] * 5 + [L, G, G], 16),  # llama.cpp's default: 6
        ({"attention.sliding_window": 16, "attention.sliding_window_pattern": 3},
         [G, G, L] * 2 + [G, G], 16),
        ({"attention.sliding_window": 16, "attention.sliding_window_pattern": 0}, [G] * 8, 16),
        ({"attention.sliding_window": 16, "attention.sliding_window_pattern": [True, False] * 4},
         [G, L] * 4, 16),
        ({}, [L] * 8, None),  # no window: every layer global
        ({"attention.sliding_window": 0}, [L] * 8, None),
    ],
)  # fmt: skip
def test_gemma3_windows_as_llama_cpp_reads_them(tmp_path, keys, layer_types, window):
    config = gguf_config(metadata_file(tmp_path / "g.gguf", "gemma3", keys))
    assert config.model_type == "gemma3_text"
    assert config.layer_types == layer_types and config.sliding_window == window


def test_gemma3_query_scale_rope_bases_and_scaling(tmp_path):
    # No key states query_pre_attn_scalar: head_dim, but hidden / heads for the 27B's 62 layers.
    keys = {"attention.key_length": 32, "attention.value_length": 32, "rope.freq_base": 1e6}
    config = gguf_config(metadata_file(tmp_path / "a.gguf", "gemma3", keys))
    assert config.head_dim == 32 and config.query_pre_attn_scalar == 32
    assert config.rope_parameters == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},  # llama.cpp's
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    }
    assert config.final_logit_softcapping is None and config.eos_token_id == 1
    config = gguf_config(metadata_file(tmp_path / "e.gguf", "gemma3", keys, eot=106))
    assert config.eos_token_id == [1, 106]  # generation ends at <end_of_turn> too
    big = keys | {"block_count": 62, "rope.freq_base_swa": 5e4, "rope.scaling.factor": 8.0}
    config = gguf_config(metadata_file(tmp_path / "b.gguf", "gemma3", big))
    assert config.query_pre_attn_scalar == 64 // 4
    # A factor without a type is linear, as llama.cpp reads it.
    assert config.rope_parameters["full_attention"] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}  # fmt: skip
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 5e4
    for refused in ({"rope.scaling.type": "yarn"}, {"rope.dimension_count": 8},
                    {"attention.key_length": 32, "attention.value_length": 16}):  # fmt: skip
        path = metadata_file(tmp_path / "c.gguf", "gemma3", refused)
        with pytest.raises(UnsupportedModelError):
            _gguf_config_dict(GGUFFile(path))


def test_phi3_window_and_longrope_as_the_converter_writes_them(tmp_path):
    # Phi-4-mini: window 0 (none), 3/4 of each head rotated, LongRoPE.
    factors = {"rope_factors_long.weight": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
               "rope_factors_short.weight": [1.0] * 6}  # fmt: skip
    keys = {
        "attention.sliding_window": 0,
        "rope.dimension_count": 12,
        "rope.scaling.original_context_length": 64,
        "rope.scaling.attn_factor": 1.25,
    }
    config = gguf_config(metadata_file(tmp_path / "p.gguf", "phi3", keys, factors))
    assert config.sliding_window is None and config.original_max_position_embeddings == 64
    assert config.rope_parameters == {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "long_factor": factors["rope_factors_long.weight"],
        "short_factor": factors["rope_factors_short.weight"],
        "original_max_position_embeddings": 64, "attention_factor": 1.25,
    }  # fmt: skip
    arch = LlamaArch.from_config(config)
    assert arch.rotary_dim == 12 and attention_scaling(arch.rope_parameters, 512) == 1.25
    # The factors are the config's, not weights the runner reports as unread.
    assert GGUFWeights(tmp_path / "p.gguf").ignored == ()
    one_set = {"rope_factors_long.weight": factors["rope_factors_long.weight"]}
    path = metadata_file(tmp_path / "q.gguf", "phi3", keys, one_set)
    with pytest.raises(UnsupportedModelError, match="both factor sets"):
        _gguf_config_dict(GGUFFile(path))


# ---- the tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("types", ["F32", "Q8_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_tensors_are_the_models_and_transformers_loading(tiny, kind, types):
    """Every tensor under the model's own name: Phi-3's fused projections as they are, Gemma's
    norms as Hugging Face holds them (the file's ``1 + w`` less 1, exactly as transformers'
    loader reads them); none of the file's tensors left unread."""
    from transformers import AutoModelForCausalLM

    made = tiny(kind, types)
    weights = GGUFWeights(made.path)
    tied = {"lm_head.weight"} if made.config.tie_word_embeddings else set()
    assert set(weights.names) == set(made.state_dict) - tied and weights.ignored == ()
    if kind.startswith("phi3"):
        assert weights.has("model.layers.0.self_attn.qkv_proj.weight")
        assert weights.shape_of("model.layers.0.mlp.gate_up_proj.weight") == (256, 64)
    model = AutoModelForCausalLM.from_pretrained(
        made.path.parent,
        gguf_file=made.path.name,
        config=weights.hf_config(),
        dtype=torch.float32,
        local_files_only=True,
    )
    reference = model.state_dict()
    for name in weights.names:
        got = weights.get(name)
        assert torch.equal(got, reference[name]), name
        if types == "F32":  # (w + 1) - 1 in float32: w to within its rounding
            torch.testing.assert_close(got, made.state_dict[name], atol=1e-7, rtol=0)
        if kind == "gemma3" and name.endswith("norm.weight"):
            assert torch.equal(weights.get(name, as_stored=True), made.state_dict[name] + 1)
        elif types == "F32":
            assert torch.equal(got, made.state_dict[name]), name
    if types != "F32":
        assert weights.format_of("model.layers.0.mlp.down_proj.weight") == types


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
    for ids in prompts(kind, 3):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        table = [next(blocks) for _ in range(-(-len(ids) // 4))]
        split = LONGROPE_ORIGINAL + 2
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
    needs_native_kernel()
    made = tiny(kind, fmt)
    with Engine(str(made.path), dtype="float32", kv_memory="16MiB") as engine:
        model = engine.runner.model
        assert engine.runner.describe()["quantization"] == "gguf"
        layer = model.layers[0]
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(linear, BlockLinear) and linear.packed == [True] * len(linear.parts)
        fused = kind.startswith("phi3")  # one stored matrix each, as the file holds them
        assert layer.qkv.formats == [fmt] * (1 if fused else 3)
        assert layer.gate_up.formats == [fmt] * (1 if fused else 2)
        assert isinstance(model.embed, BlockEmbedding) and model.embed.blocks.format.name == "Q8_0"
        assert isinstance(model.lm_head, BlockLinear)
        if kind == "gemma3":  # the stored 1 + w, taken as it is
            stored = GGUFWeights(made.path).get("model.layers.0.input_layernorm.weight", True)
            assert torch.equal(layer.input_norm, stored)
        sampling = {"max_new_tokens": 4, "ignore_eos": True}
        assert len(engine.generate("hello", sampling).output_ids) == 4
    written = {p.name for p in (cache / "models").rglob("*") if p.is_file()}
    assert "config.json" in written and not [n for n in written if "safetensors" in n]


# The quantized runner's largest logit error against the dequantized model, as a fraction of
# the logits' standard deviation: int8 activations (llama.cpp's) are the only difference.
# Measured on these files: 0.05-0.10; a misread tensor gives errors of the logits' own size.
LOGIT_ERROR = 0.25


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_file_is_close_to_the_model_dequantized(tiny, kind, fmt):
    """Against the same file converted to float32 (quantization="none": transformers'
    dequantizing, then the float runner): logits within LOGIT_ERROR, greedy tokens the same
    until a near tie of the float model."""
    needs_native_kernel()
    path = str(tiny(kind, fmt).path)
    runners = [
        ModelRunner(path, num_blocks=16),
        ModelRunner(path, num_blocks=16, quantization="none"),
    ]
    assert [r.describe()["quantization"] for r in runners] == ["gguf", "none"]
    for ids in prompts(kind, 3, seed=2):
        got, want = (r.forward([SequenceInput(ids, 0, [0, 1, 2])]).logits[0] for r in runners)
        assert (got - want).abs().max() < LOGIT_ERROR * want.std()
    with (
        Engine(path, dtype="float32", kv_memory="16MiB") as quantized,
        Engine(path, dtype="float32", kv_memory="16MiB", quantization="none") as reference,
    ):
        assert check_close_to_float(quantized, reference, PROMPTS) > 0
