"""GGUFWeights (runtime/models/gguf_weights.py) against transformers' own GGUF loading and the
weights the files were made from, on tiny random models written as llama.cpp writes them
(tests/gguf_files.py): names, reversed shapes, dequantization, the q/k row unpermute, raw blocks.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_files import BYTES_VOCAB, write_tiny_gguf

from radixlang.model_files import UnsupportedModelError
from radixlang.runtime.models.gguf_weights import GGUFWeights, hf_config, unpermute_rows

TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1")
# name: (arch, type of the layers' 2-D weights, of token_embd/output, config overrides)
CASES = {f"{a}-{t}": (a, t, "F32", {}) for a in ("llama", "qwen2", "qwen3") for t in TYPES}
CASES |= {
    "llama-Q4_1-embQ8_0": ("llama", "Q4_1", "Q8_0", {}),  # the default model's mix
    "llama-Q4_0-bias": ("llama", "Q4_0", "F32", {"attention_bias": True}),  # permuted q/k biases
    "mistral-Q8_0": ("mistral", "Q8_0", "Q4_0", {}),
}
FLOAT_CASES = [c for c, (_, t, emb, _) in CASES.items() if t in ("F32", "F16") and emb == "F32"]
QUANT_CASES = [c for c, (_, t, _, _) in CASES.items() if t in QUANTIZED]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The file of a case, written once per module (all in one folder, as transformers wants)."""
    folder = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(case: str):
        if case not in made:
            arch, types, embed_type, overrides = CASES[case]
            path = folder / f"{case}.gguf"
            made[case] = write_tiny_gguf(
                path, arch=arch, types=types, embed_type=embed_type, **overrides
            )
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_equals_transformers_loading(tiny, case):
    from transformers import AutoModelForCausalLM

    made = tiny(case)
    weights = GGUFWeights(made.path)
    model = AutoModelForCausalLM.from_pretrained(
        made.path.parent,
        gguf_file=made.path.name,
        config=weights.hf_config(),  # AutoConfig's, with qwen3's head_dim put right
        dtype=torch.float32,
        local_files_only=True,
    )
    reference = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(weights.names) == set(reference) - tied
    for name in weights.names:
        got = weights.get(name)
        assert got.dtype == torch.float32 and got.shape == reference[name].shape, name
        assert torch.equal(got, reference[name]), name


@pytest.mark.parametrize("case", FLOAT_CASES)
def test_float_tensors_equal_the_original_weights(tiny, case):
    made = tiny(case)
    weights = GGUFWeights(made.path)
    for name in weights.names:
        want = made.state_dict[name]
        if weights.format_of(name) == "F16":
            want = want.half().float()
        assert torch.equal(weights.get(name), want), name


@pytest.mark.parametrize("case", QUANT_CASES)
def test_blocks_dequantize_to_get(tiny, case):
    made = tiny(case)
    weights = GGUFWeights(made.path)
    for name in weights.names:
        raw = weights.blocks(name)
        if weights.format_of(name) not in QUANTIZED:
            assert raw is None, name
            continue
        assert raw is not None and raw.format.name == weights.format_of(name)
        values = weights.get(name).numpy()
        assert (raw.rows, raw.cols) == values.shape == weights.shape_of(name)
        qtype = GGMLQuantizationType(raw.format.ggml_type)
        assert np.array_equal(dequantize(raw.data, qtype), values), name
    # The stored bytes as the gguf package's own reader sees them.
    reader = gguf.GGUFReader(weights.path, "r")
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    permuted = CASES[case][0] in ("llama", "mistral")
    assert np.array_equal(weights.blocks(Q_PROJ).data, stored.data) != permuted


def test_blocks_are_views_of_the_map_unless_rows_move(tiny):
    llama = GGUFWeights(tiny("llama-Q4_0").path)
    down = llama.blocks(DOWN_PROJ)
    # down_proj is [hidden, intermediate] = [64, 128]: 4 blocks of 18 bytes a row
    assert (down.rows, down.cols, down.data.shape) == (64, 128, (64, 72))
    assert np.shares_memory(down.data, llama.file.mapped)
    assert not np.shares_memory(llama.blocks(Q_PROJ).data, llama.file.mapped)  # unpermuted copy
    qwen = GGUFWeights(tiny("qwen2-Q4_0").path)
    assert np.shares_memory(qwen.blocks(Q_PROJ).data, qwen.file.mapped)
    for case in ("llama-F32", "llama-F16"):
        floats = GGUFWeights(tiny(case).path)
        assert floats.blocks(DOWN_PROJ) is None and floats.blocks("model.norm.weight") is None


def test_unpermute_matches_transformers_and_inverts_llama_cpp():
    from gguf_files import _permute
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reverse = LlamaTensorProcessor()._reverse_permute_weights
    for rows, heads in ((64, 4), (32, 2), (96, 3), (8, 1)):
        hf = np.arange(rows * 3).reshape(rows, 3)
        stored = _permute(hf, heads)
        assert not np.array_equal(stored, hf)
        assert np.array_equal(stored[unpermute_rows(rows, heads)], hf)
        assert np.array_equal(reverse(stored, heads, heads), hf)
    with pytest.raises(UnsupportedModelError):
        unpermute_rows(12, 4)


def test_format_shape_and_sizes(tiny):
    made = tiny("llama-Q4_1-embQ8_0")
    weights = GGUFWeights(made.path)
    assert weights.architecture == "llama"
    assert weights.format_of("model.embed_tokens.weight") == "Q8_0"
    assert weights.format_of("lm_head.weight") == "Q8_0"
    assert weights.format_of(Q_PROJ) == "Q4_1"
    assert weights.format_of("model.norm.weight") == "F32"
    # GGUF's (in, out) read back as Hugging Face's [out, in]
    assert weights.shape_of(DOWN_PROJ) == (64, 128)
    assert weights.shape_of("model.layers.1.mlp.up_proj.weight") == (128, 64)
    assert weights.shape_of("model.layers.0.self_attn.k_proj.weight") == (2 * 16, 64)
    reader = gguf.GGUFReader(weights.path, "r")
    assert weights.num_bytes == sum(int(t.n_bytes) for t in reader.tensors)

    f32 = GGUFWeights(tiny("qwen2-F32").path)  # tied: no lm_head in the file
    assert not f32.has("lm_head.weight")
    assert f32.num_bytes == 4 * sum(t.numel() for n, t in tiny("qwen2-F32").state_dict.items()
                                    if n != "lm_head.weight")  # fmt: skip


def test_unknown_tensors_are_listed_and_missing_names_raise(tmp_path):
    extra = {"rope_freqs.weight": np.ones(8, np.float32)}
    made = write_tiny_gguf(tmp_path / "x.gguf", layers=1, extra_tensors=extra)
    weights = GGUFWeights(made.path)
    assert weights.ignored == ("rope_freqs.weight",)
    assert not weights.has("rope_freqs.weight") and "rope_freqs.weight" not in weights.names
    missing = "model.layers.1.mlp.up_proj.weight"
    for read in (weights.get, weights.blocks, weights.format_of):
        with pytest.raises(UnsupportedModelError, match=f"{missing!r} is missing"):
            read(missing)


def test_unsupported_files_raise(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        GGUFWeights(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(tmp_path / "gemma.gguf", "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'gemma'"):
        GGUFWeights(tmp_path / "gemma.gguf")


@pytest.mark.parametrize("case", ["llama-Q8_0", "qwen2-Q8_0", "qwen3-Q8_0", "mistral-Q8_0"])
def test_config_from_metadata(tiny, case):
    from transformers import AutoConfig

    made = tiny(case)
    config, want = hf_config(made.path), made.config
    # llama.cpp writes Mistral as llama; transformers reads it back so
    assert config.model_type == ("llama" if want.model_type == "mistral" else want.model_type)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, key) == getattr(want, key), key
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    head_dim = getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads
    assert (getattr(config, "head_dim", None) or head_dim) == head_dim
    if case.startswith("qwen3"):
        # transformers maps no head size for qwen3: its Qwen3Config defaults to 128
        plain = AutoConfig.from_pretrained(made.path.parent, gguf_file=made.path.name)
        assert plain.head_dim == 128 != config.head_dim == 24


CHAT = [{"role": "user", "content": "hi"}]


def test_bytes_tokenizer_loads(tiny):
    from transformers import AutoTokenizer

    made = tiny("llama-Q8_0")
    tokenizer = AutoTokenizer.from_pretrained(made.path.parent, gguf_file=made.path.name)
    assert len(tokenizer) == BYTES_VOCAB == made.config.vocab_size
    text = "Hello, the world! ünïcödé 🙂\n\tend"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer(" the").input_ids == [tokenizer.convert_tokens_to_ids("Ġthe")]  # merges
    assert tokenizer("<|im_end|>").input_ids == [2] and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_default_model_tokenizer_copies(tmp_path):
    from transformers import AutoTokenizer

    made = write_tiny_gguf(tmp_path / "smol.gguf", layers=1, tokenizer="smollm2")
    assert made.config.vocab_size == 49152
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="smol.gguf")
    assert len(tokenizer) == 49152
    # the ids SmolLM2-135M-Instruct's own tokenizer gives
    assert tokenizer("Hello world <|im_end|>").input_ids == [19556, 905, 216, 2]
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in prompt
