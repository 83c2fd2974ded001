"""GGUF weights read in place: a memory-mapped ``.gguf`` file's tensors under Hugging Face names.

``GGUFWeights`` has the safetensors reader's interface (``has``, ``get``) and adds ``blocks``:
a quantized matrix in one of the kernels' block formats (``kernels/block_formats.py``) comes
back as its raw GGUF blocks, a view of the map where no row has to move, so it is never
dequantized. ``get`` returns float32 for any stored type (quantized ones dequantized by the
``gguf`` package, as transformers does).

Two conventions of llama.cpp's converter are undone here, as transformers undoes them:

- GGUF lists a tensor's dimensions innermost first: a ``[out, in]`` weight is stored with
  shape ``(in, out)``; its rows (``out``) are still the stored rows.
- For the ``llama`` architecture (which llama.cpp also writes Mistral models as) the rows of
  ``q_proj`` and ``k_proj`` (weights and biases) are permuted per head from Hugging Face's
  rotate-half layout to interleaved pairs. Qwen2, Qwen3, Phi-3 and Gemma 3 files are written
  unpermuted.

and two are kept as they are stored, with the runner told:

- Phi-3 (``phi3``) keeps q/k/v fused as ``attn_qkv`` and gate/up as ``ffn_up`` (gate rows
  first), as its Hugging Face checkpoints do: they map to ``qkv_proj`` and ``gate_up_proj``.
- Gemma 3 (``gemma3``) stores every norm weight as it is applied, ``1 + w`` (the converter adds
  the 1 of Gemma's RMSNorm): ``get`` gives Hugging Face's ``w`` back (as transformers' loader
  does), ``get(name, as_stored=True)`` the stored ``1 + w``, which the runner applies as it is.
  Its ``ffn_norm`` is the MLP's input norm (``pre_feedforward_layernorm``), beside
  ``post_attention_norm`` and ``post_ffw_norm``.
- Mixture-of-experts layers (``qwen3moe``; Mixtral, which llama.cpp writes as ``llama`` with
  ``llama.expert_count``) keep each layer's experts as three 3-D tensors, ``ffn_gate_exps``,
  ``ffn_up_exps`` and ``ffn_down_exps`` (``[experts, rows, cols]``, every expert's rows whole
  blocks, one expert after another): they map to ``mlp.experts.gate_proj``, ``up_proj`` and
  ``down_proj`` (no ``.weight``, as transformers 5 names its fused 3-D expert tensors; its
  ``gate_up_proj`` is the first two stacked by rows), and ``get``/``blocks`` take an ``expert``
  for one expert's matrix, a view of the map. The router, ``ffn_gate_inp``, is ``mlp.gate``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from radixlang.gguf_file import GGUFFile, GGUFFormatError, TensorEntry
from radixlang.kernels import block_linear
from radixlang.kernels.block_formats import BY_GGML_TYPE, RawBlocks
from radixlang.model_files import GGUF_WEIGHT_WRITERS, UnsupportedModelError, gguf_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The general.architecture values whose tensors map onto our Hugging Face names.
SUPPORTED_ARCHITECTURES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe"}
)
# Those whose q/k rows llama.cpp permuted (transformers' TENSOR_PROCESSORS: "llama" only; a
# file that says "mistral" is not one llama.cpp writes, and transformers leaves it unpermuted).
PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a sparse layer's router
}
# A sparse layer's experts: 3-D tensors, named without ``.weight`` as transformers 5 names them.
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Where an architecture's layer names differ from the above (gguf's MODEL_TENSORS of it).
_ARCH_LAYER_NAMES = {
    "phi3": _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": _LAYER_NAMES
    | {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# What llama.cpp's converter added to every norm weight of an architecture (Gemma's 1 + w).
NORM_SHIFTS = {"gemma3": 1.0}
# Tensors the config reads (LongRoPE's factor sets), not weights of a layer.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_Q_OR_K = re.compile(r"model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name of ``arch``, or None for one we do not
    map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    if match[2] in _EXPERT_NAMES and match[3] == "weight":
        return f"model.layers.{match[1]}.{_EXPERT_NAMES[match[2]]}"
    if match[2] not in names:
        return None
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rope permutation of a q or k projection.

    llama.cpp (``LlamaModel.permute``) stores head ``h``'s row ``j * half + i`` (``j`` in 0..1,
    the rotate-half of Hugging Face) at ``i * 2 + j``; ``hf = stored[order]`` puts it back, as
    transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does.
    """
    if rows % (2 * heads):
        raise UnsupportedModelError(f"{rows} q/k rows do not split into {heads} heads of pairs")
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


class GGUFWeights:
    """Tensors by Hugging Face name in one memory-mapped ``.gguf`` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except (OSError, GGUFFormatError) as error:
            raise UnsupportedModelError(
                f"{self.path} is not a readable GGUF file: {error}"
            ) from error
        arch = self.metadata("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        self._arch: str = arch
        # What to subtract from a norm weight for Hugging Face's value (see the top).
        self.norm_shift: float = NORM_SHIFTS.get(arch, 0.0)
        self._tensors: dict[str, TensorEntry] = {}
        ignored = []
        for tensor in self.file.tensors.values():
            name = hf_name(tensor.name, arch)
            if name is not None:
                self._tensors[name] = tensor
            elif tensor.name not in CONFIG_TENSORS:
                ignored.append(tensor.name)
        # GGUF names of tensors we do not map (e.g. rope_freqs.weight), for callers to report.
        self.ignored: tuple[str, ...] = tuple(ignored)
        self._heads: dict[str, int] = {}
        if arch in PERMUTED_ARCHITECTURES:
            heads = self.metadata(f"{arch}.attention.head_count")
            kv_heads = self.metadata(f"{arch}.attention.head_count_kv", heads)
            if not isinstance(heads, int) or not isinstance(kv_heads, int):
                raise UnsupportedModelError("per-layer head counts are not supported")
            self._heads = {"q": heads, "k": kv_heads}

    @property
    def architecture(self) -> str:
        """``general.architecture`` (llama.cpp writes Mistral models as "llama")."""
        return self._arch

    @property
    def names(self) -> tuple[str, ...]:
        """The Hugging Face names of the tensors this file holds, in file order."""
        return tuple(self._tensors)

    @property
    def num_bytes(self) -> int:
        """Bytes of the mapped tensors as stored (quantized ones at their block size)."""
        return sum(t.num_bytes for t in self._tensors.values())

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool or list), or ``default``."""
        return self.file.get(key, default)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def format_of(self, name: str) -> str:
        """The stored GGML type's name ("F32", "F16", "Q4_0", ...)."""
        return self._tensor(name).type_name

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape (GGUF's dimensions reversed: ``[out, in]``; an expert tensor's
        ``[experts, out, in]``)."""
        return tuple(reversed(self._tensor(name).dims))

    def get(self, name: str, as_stored: bool = False, expert: int | None = None) -> torch.Tensor:
        """The tensor in float32, dequantized if stored quantized, q/k rows unpermuted; a norm
        weight as Hugging Face holds it (Gemma's ``w``), or ``as_stored`` as the file does
        (Gemma's ``1 + w``); ``expert``: that expert's matrix of an expert tensor (only its
        bytes read)."""
        if self.norm_shift and not as_stored and name.endswith("norm.weight"):
            return self.get(name, as_stored=True) - self.norm_shift
        tensor = self._tensor(name)
        shape = self.shape_of(name)[0 if expert is None else 1 :]
        raw = self._raw(name, expert)
        order = self._row_order(name)
        if raw is not None and block_linear.available():  # the native dequantizer: fast
            if order is not None:
                raw = raw.take_rows(order)
            return block_linear.dequantize(raw).reshape(shape)
        data = self._data(tensor, expert)
        try:
            values = dequantize(
                data.reshape(*shape[:-1], -1), GGMLQuantizationType(tensor.ggml_type)
            )
        except (NotImplementedError, ValueError) as error:
            raise UnsupportedModelError(
                f"weight {name!r} is stored as {tensor.type_name}, which cannot be read"
            ) from error
        values = values.reshape(shape)
        if order is not None:
            values = values[order]
        elif not values.flags.writeable:
            values = values.copy()  # F32 is a read-only view of the map; tensors own their memory
        return torch.from_numpy(values.astype(np.float32, copy=False))

    def blocks(self, name: str, expert: int | None = None) -> RawBlocks | None:
        """The matrix (``expert``: that expert's of an expert tensor) as raw GGUF blocks if
        stored in a kernel block format, else None.

        Zero-copy (a view of the map) unless the rows had to be unpermuted."""
        raw = self._raw(name, expert)
        order = self._row_order(name)
        return raw if raw is None or order is None else raw.take_rows(order)

    def release(self, name: str, expert: int | None = None) -> None:
        """The tensor's bytes (``expert``: that expert's) were copied (repacked by the kernels):
        unmap their pages from this process, so that the model's resident memory is its file's
        size once, not twice."""
        tensor = self._tensor(name)
        if expert is not None:
            self._data(tensor, expert)  # (refuses an expert the tensor does not hold)
            size = tensor.num_bytes // tensor.dims[2]
            tensor = dataclasses.replace(
                tensor, offset=tensor.offset + expert * size, num_bytes=size
            )
        self.file.drop_pages(tensor)

    def _data(self, tensor: TensorEntry, expert: int | None) -> np.ndarray:
        """The stored bytes of the tensor, or of one expert's matrix of a 3-D expert tensor
        (experts lie one after another, each ``num_bytes / experts`` long)."""
        data = self.file.data(tensor)
        if expert is None:
            return data
        if len(tensor.dims) != 3 or not 0 <= expert < tensor.dims[2]:
            raise UnsupportedModelError(f"{tensor.name} holds no expert {expert}")
        size = tensor.num_bytes // tensor.dims[2]
        return data[expert * size : (expert + 1) * size]

    def _raw(self, name: str, expert: int | None = None) -> RawBlocks | None:
        """The stored blocks of a matrix in a kernel block format, rows as stored: a 2-D
        tensor's, an expert's of a 3-D one, or a 3-D one's experts' rows one after another."""
        tensor = self._tensor(name)
        data = self._data(tensor, expert)  # (refuses an expert the tensor does not hold)
        block_format = BY_GGML_TYPE.get(tensor.ggml_type)
        if block_format is None or len(tensor.dims) not in (2, 3):
            return None
        cols, rows = tensor.dims[:2]
        if len(tensor.dims) == 3 and expert is None:
            rows *= tensor.dims[2]
        data = data.reshape(rows, -1)
        return RawBlocks(block_format, rows, cols, data)

    def hf_config(self) -> PretrainedConfig:
        """The transformers config of this file (see ``model_files.gguf_config``)."""
        return gguf_config(self.path)

    def _tensor(self, name: str) -> TensorEntry:
        if name not in self._tensors:
            raise UnsupportedModelError(f"weight {name!r} is missing from {self.path.name}")
        return self._tensors[name]

    def _row_order(self, name: str) -> np.ndarray | None:
        if not self._heads:
            return None
        match = _Q_OR_K.fullmatch(name)
        if match is None:
            return None
        return unpermute_rows(self.shape_of(name)[0], self._heads[match[1]])


def hf_config(path: str | Path) -> PretrainedConfig:
    """The transformers config of a ``.gguf`` file (see ``GGUFWeights.hf_config``)."""
    return GGUFWeights(path).hf_config()


def save_dequantized_weights(gguf: Path, out: Path) -> None:
    """The file's tensors in float32 as ``model.safetensors`` under transformers 5's names (the
    experts' gate and up stacked into its fused ``gate_up_proj``): a Mixtral file, which
    transformers cannot load, converted for ``quantization="none"``."""
    from safetensors.torch import save_file

    weights = GGUFWeights(gguf)
    tensors = {}
    for name in weights.names:
        if name.endswith("mlp.experts.up_proj"):
            continue  # stacked under its gate
        if name.endswith("mlp.experts.gate_proj"):
            stem = name.removesuffix("gate_proj")
            gate, up = weights.get(name), weights.get(stem + "up_proj")
            tensors[stem + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        else:
            tensors[name] = weights.get(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


GGUF_WEIGHT_WRITERS["mixtral"] = save_dequantized_weights
