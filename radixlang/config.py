"""One configuration for the engine, the scheduler and the server: a TOML file plus flags.

A file has two tables, ``[engine]`` and ``[server]`` (see ``SETTINGS`` for their keys). The
effective value of a setting is the flag's when one was given, else the file's, else the
default. The file comes from ``--config FILE`` or, failing that, ``$RADIXLANG_CONFIG``.

Every bad key or value is a :class:`ConfigError` that names it (``engine.block_size must be a
positive integer, got 'x'``). This module imports no layer of the package (no torch), so
``radixlang config --print`` answers at once; the engine still checks what it is given.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any

from radixlang.model_files import DEFAULT_MODEL

CONFIG_ENV = "RADIXLANG_CONFIG"
SECTIONS = ("engine", "server")
# The scheduler's and the weights' names (runtime/scheduler.py SchedulePolicy, and "auto"
# beside model_runner's DTYPES); tests/test_config.py checks these lists against the runtime.
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight", "program")
# How long a call that may end at a tool call asks the engine to keep its path (retain_s) by
# default: the program is back once its tools return (tens of ms to seconds); the engine cuts
# it to its retain_max_s, and the program's end releases it sooner.
TOOL_CALL_RETAIN_S = 30.0
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (
    "auto",
    "none",
    "int8",
    "gguf",
    "q8_0",
    "q4_0",
)  # the runtime's models/linear.py QUANTIZATIONS
PREEMPTIONS = ("recompute", "swap")  # runtime/scheduler.py Preemption
SPECULATIVE = ("off", "ngram")  # runtime/speculative
# constrain/tool_formats.NAMED_FORMATS; "auto" and "template" read the chat template's
TOOL_CALL_FORMATS = ("auto", "template", "radixlang", "hermes", "llama3-json", "mistral")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTING_POLICIES = ("cache_aware", "round_robin")  # cluster/router.py POLICIES
# The pool's size when neither engine.kv_memory nor engine.num_blocks is given.
DEFAULT_KV_MEMORY = "1GiB"
# A memory size: a number and an optional unit (decimal K/M/G/T, binary Ki/Mi/Gi/Ti, B or not).
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_UNITS |= {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_memory(value: int | str | None) -> int | None:
    """Bytes from an int or a size such as ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.fullmatch(value)
    if not m:
        raise ValueError(f"kv_memory must be bytes or a size like '2GiB'; got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper().removesuffix("B")])


class ConfigError(ValueError):
    """A configuration key or value that is not valid; the message names it."""


MAX_TENANT_CHARS = 256


def load_api_keys(path: str | Path) -> dict[str, str]:
    """An API-keys file: a JSON or TOML table of ``key = "tenant"`` (``.json`` is read as
    JSON, anything else as TOML). Keys and tenant names are non-empty strings, names at most
    256 characters; several keys may name one tenant."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"API-keys file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"API-keys file {str(path)!r} cannot be read: {e}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"API-keys file {str(path)!r} is not valid: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"API-keys file {str(path)!r} must map API keys to tenant names")
    for key, tenant in data.items():
        if not key or not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise ConfigError(
                f"API-keys file {str(path)!r}: each key needs a tenant name, a string of 1 to "
                f"{MAX_TENANT_CHARS} characters"
            )
    return dict(data)


# ---- kinds of value ------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """What a setting's value must be: ``check`` takes a TOML value, ``parse`` a flag's text.
    Both return the value to keep or raise ``ValueError`` with ``description``."""

    description: str
    check: Callable[[Any], Any]
    parse: Callable[[str], Any]
    choices: tuple[str, ...] = ()
    metavar: str | None = None  # the flag's placeholder (default: the key in capitals)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_kind(description: str, ok: Callable[[int], bool], metavar: str = "N") -> Kind:
    def check(value: Any) -> int:
        if not _is_int(value) or not ok(value):
            raise ValueError(description)
        return value

    def parse(text: str) -> int:
        try:
            return check(int(text.strip()))
        except ValueError:
            raise ValueError(description) from None

    return Kind(description, check, parse, metavar=metavar)


def _number_kind(description: str, positive: bool = False) -> Kind:
    def check(value: Any) -> float:
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise ValueError(description)
        if value < 0 or (positive and value == 0):
            raise ValueError(description)
        return float(value)

    def parse(text: str) -> float:
        try:
            return check(float(text.strip()))
        except ValueError:
            raise ValueError(description) from None

    return Kind(description, check, parse, metavar="SECONDS")


def _fraction_kind(description: str) -> Kind:
    number = _number_kind(description)

    def check(value: Any) -> float:
        value = number.check(value)
        if value > 1:
            raise ValueError(description)
        return value

    def parse(text: str) -> float:
        return check(number.parse(text))

    return Kind(description, check, parse, metavar="FRACTION")


def _choice_kind(choices: Sequence[str]) -> Kind:
    description = "one of " + ", ".join(choices)

    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(description)
        return value

    return Kind(description, check, check, tuple(choices))


def _text_kind(description: str, pattern: str | None = None) -> Kind:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(description)
        if pattern is not None and not re.fullmatch(pattern, value):
            raise ValueError(description)
        return value

    return Kind(description, check, check)


def _size_check(value: Any) -> int | str:
    description = "a size such as '512MiB' or '2GiB', or a number of bytes"
    if _is_int(value) and value > 0:
        return value
    if isinstance(value, str) and _SIZE.fullmatch(value) and float(_SIZE.fullmatch(value)[1]):
        return value
    raise ValueError(description)


def _size_parse(text: str) -> int | str:
    return _size_check(int(text) if text.strip().isdigit() else text)


def _origins_check(value: Any) -> tuple[str, ...]:
    description = "a list of origins such as ['http://localhost:3000']"
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, str) and v.strip() for v in value
    ):
        raise ValueError(description)
    return tuple(value)


def _step_cost_check(value: Any) -> tuple[float, float, float]:
    description = (
        "three milliseconds, a decode step's fixed cost, per sequence and per token, such as "
        "[19, 1, 0.4] (the first > 0, the others >= 0)"
    )
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(description)
    numbers = [_number_kind(description).check(v) for v in value]
    if numbers[0] <= 0:
        raise ValueError(description)
    return (numbers[0], numbers[1], numbers[2])


def _step_cost_parse(text: str) -> tuple[float, float, float]:
    try:
        return _step_cost_check([float(v) for v in text.split(",")])
    except ValueError:
        return _step_cost_check(None)  # the description, not float()'s message


def _check_threads(threads: Any) -> int | None:
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
    return threads


def _bool_check(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _bool_parse(text: str) -> bool:
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if text.strip().lower() not in words:
        raise ValueError("true or false")
    return words[text.strip().lower()]


POSITIVE_INT = _int_kind("a positive integer", lambda v: v > 0)
INTEGER = _int_kind("an integer", lambda v: True)
PORT = _int_kind("a port number from 0 to 65535", lambda v: 0 <= v <= 65535, "PORT")
SECONDS = _number_kind("a number of seconds >= 0")
POSITIVE_SECONDS = _number_kind("a number of seconds > 0", positive=True)
FRACTION = _fraction_kind("a number from 0 to 1")
STEP_COST = Kind(
    "three milliseconds, a decode step's fixed cost, per sequence and per token, such as "
    "[19, 1, 0.4] (the first > 0, the others >= 0)",
    _step_cost_check,
    _step_cost_parse,
    metavar="MS,MS,MS",
)
SIZE = Kind(
    "a size such as '512MiB' or '2GiB', or a number of bytes",
    _size_check,
    _size_parse,
    metavar="SIZE",
)
TEXT = _text_kind("a non-empty string")
# A flag pair: --key and --no-key.
BOOL = Kind("true or false", _bool_check, _bool_parse)
DEVICE = _text_kind("a device such as 'cpu', 'cuda' or 'cuda:1'", r"[a-z]+(:[0-9]+)?")
# A flag takes the origins as separate words (nargs="+"), each checked as a one-item list.
ORIGINS = Kind(
    "a list of origins such as ['http://localhost:3000']",
    _origins_check,
    lambda text: _origins_check([text])[0],
)


# ---- the settings --------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One key of the file, with its flag (``--`` and the key with dashes)."""

    section: str
    key: str
    kind: Kind
    default: Any  # None: unset, the engine or server decides
    help: str
    metavar: str | None = None  # the flag's placeholder, where the kind's is not apt
    aliases: tuple[str, ...] = ()  # other spellings of the flag
    # None is a value of its own (e.g. no time limit) where the default is not None.
    nullable: bool = False
    # A check of the Python API's values, where the kind's (of TOML values) is not the one.
    python_check: Callable[[Any], Any] | None = None
    # The Python API also takes objects a file cannot hold (a Path, a torch dtype or device, a
    # ModelFiles): those are checked where they are used.
    takes_objects: bool = False

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def check_python(self, value: Any) -> Any:
        """``value`` as a keyword argument gives it (``Engine(key=value)``), checked; raises
        ``ValueError`` naming the key (see ``takes_objects`` for what is checked later)."""
        if self.python_check is not None:
            return self.python_check(value)
        if value is None and (self.default is None or self.nullable):
            return None
        if self.takes_objects and not isinstance(value, str):
            return value
        try:
            return self.kind.check(value)
        except ValueError:
            what = "True or False" if self.kind is BOOL else self.kind.description
            raise ValueError(f"{self.key} must be {what}, got {value!r}") from None


ENGINE_SETTINGS = (
    Setting("engine", "model", TEXT, DEFAULT_MODEL, "a model name, a folder or a .gguf file",
            takes_objects=True),
    Setting("engine", "dtype", _choice_kind(DTYPES), "auto",
            "weights' dtype; auto: bfloat16 where the hardware computes it natively, else "
            "float32", takes_objects=True),
    Setting("engine", "device", DEVICE, "cpu", "cpu, cuda or cuda:N", takes_objects=True),
    Setting("engine", "kv_memory", SIZE, None,
            f"KV cache size, e.g. 512MiB or 2GiB (default {DEFAULT_KV_MEMORY}; not with "
            "num_blocks)"),
    Setting("engine", "num_blocks", POSITIVE_INT, None,
            "KV cache size in blocks (instead of kv_memory)"),
    Setting("engine", "block_size", POSITIVE_INT, 16, "tokens per KV block"),
    Setting("engine", "max_running_requests", POSITIVE_INT, 256,
            "requests decoding at once"),
    Setting("engine", "max_batch_tokens", POSITIVE_INT, None,
            "tokens per engine step (default 2048 on CPUs, 8192 on GPUs)"),
    Setting("engine", "schedule_policy", _choice_kind(SCHEDULE_POLICIES), "lpm",
            "admission order: lpm (longest cached prefix first), fcfs, dfs-weight, or program "
            "(the least served program first: a program's calls so far count, as Autellix)"),
    Setting("engine", "max_context", POSITIVE_INT, None,
            "cap on a sequence's length in tokens (default: the model's context)"),
    Setting("engine", "allow_auto_truncate", BOOL, False,
            "cut a max_new_tokens that does not fit in the context after the prompt to what "
            "fits, instead of refusing the request (a 400); SGLang's flag (default: off)"),
    Setting("engine", "threads", POSITIVE_INT, None,
            "CPU threads for the forward pass, fixed (default: torch's count, lowered while "
            "other processes keep cores busy and raised again after)", aliases=("--cpu-threads",),
            python_check=_check_threads),
    Setting("engine", "adapt_threads", BOOL, None,
            "lower the forward's CPU threads while other processes keep cores busy, raise them "
            "again after (default: on for CPUs without a fixed thread count, unless "
            "$RADIXLANG_ADAPT_THREADS is 0)"),
    Setting("engine", "quantization", _choice_kind(QUANTIZATIONS), "auto",
            "weights: auto (the default: a .gguf file's blocks as stored, other models in the "
            "dtype), none (the dtype's; a GGUF dequantized), int8 (weight-only, one scale per "
            "output row; CPUs), gguf (a GGUF model's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks "
            "multiplied in place, from the memory-mapped file; CPUs), q8_0 or q4_0 (the "
            "layers' weights quantized at load into those blocks; CPUs)"),
    Setting("engine", "host_tier_memory", SIZE, None,
            "a second tier for evicted prefixes' KV, e.g. 4GiB (off by default): pinned host "
            "memory for a GPU pool; host memory for a CPU pool, or a memory-mapped file under "
            "cache_dir when over half the available memory"),
    Setting("engine", "disk_tier_size", SIZE, None,
            "a disk tier under the host tier, e.g. 32GiB (needs host_tier_memory): what the "
            "host tier would drop is spilled to a file under cache_dir (else the temp folder) "
            "and loaded back from it"),
    Setting("engine", "prefetch", BOOL, True,
            "with a host tier, load tiered prefixes back on a copy thread before their request "
            "is admitted: when it arrives, and when a paused program's predicted return nears"),
    Setting("engine", "preemption", _choice_kind(PREEMPTIONS), None,
            "a retracted request's KV: swap (to the host tier, loaded back; the default with "
            "one) or recompute (left in the device cache; the default without)"),
    Setting("engine", "retain_max_s", SECONDS, 60.0,
            "the longest a request may ask the cache to keep its path for its program's next "
            "call (retain_s: a program paused at a tool call); 0 turns retention off"),
    Setting("engine", "retain_max_share", FRACTION, 0.5,
            "the share of the KV pool that retained paths may hold; past it the retentions "
            "nearest their deadline end"),
    Setting("engine", "cache_dir", TEXT, None,
            "a folder where the radix cache is saved at shutdown and loaded at start (and "
            "where the host tier's file lives)", metavar="DIR", takes_objects=True),
    # llguidance compiles the grammars people write in milliseconds; one that takes seconds
    # is pathological (or hostile), and its request is refused.
    Setting("engine", "grammar_compile_timeout", POSITIVE_SECONDS, 5.0,
            "seconds one request's regex, JSON schema or grammar may take to compile; a slower "
            "one is refused as a bad request (None in Python: no limit)", nullable=True),
    Setting("engine", "jump_forward", BOOL, True,
            "jump-forward decoding: text a request's grammar forces is appended at once and "
            "computed in the next step, not one decode step per token"),
    Setting("engine", "overlap_masks", BOOL, True,
            "fill grammar masks on a worker thread while the forward runs"),
    Setting("engine", "seed", INTEGER, 0, "the engine's sampling seed"),
    Setting("engine", "kv_events", BOOL, False,
            "announce the blocks the radix cache stores and removes (GET /kv_events), for "
            "routers"),
    Setting("engine", "overlap", BOOL, None,
            "overlapped scheduling: schedule the next decode step, and detokenize the last, "
            "while a step runs (default: on for CUDA, off elsewhere; not with a host tier)"),
    Setting("engine", "cuda_graphs", BOOL, None,
            "replay decode steps as CUDA graphs, captured at start (default: on for CUDA "
            "with the Triton kernels)"),
    Setting("engine", "deterministic", BOOL, False,
            "deterministic inference: a request's logits, tokens and logprobs bitwise the "
            "same whatever else is in its batch (batch-invariant kernels; slower)"),
    Setting("engine", "kv_dtype", _choice_kind(DTYPES[1:]), None,
            "the KV cache's dtype (default: the weights')", takes_objects=True),
    Setting("engine", "speculative", _choice_kind(SPECULATIVE), "off",
            "speculative decoding without a draft model: ngram drafts each decode from the "
            "request's own text, other requests' and the radix cache's paths, verified in one "
            "forward, as many tokens per request as its acceptance pays for"),
    Setting("engine", "speculative_num_draft_tokens", POSITIVE_INT, 8,
            "the most draft tokens one request verifies in a step"),
    Setting("engine", "speculative_step_cost_ms", STEP_COST, None,
            "pin the drafts' cost model to a decode step's milliseconds: fixed, per sequence, "
            "per token (e.g. 19,1,0.4); default: learnt from the engine's own steps. Pinned, "
            "the drafts taken depend on the requests alone, not on the machine's speed or load"),
    Setting("engine", "tool_call_format", _choice_kind(TOOL_CALL_FORMATS), "auto",
            "how the model writes tool calls: auto reads the format off the chat template "
            "(radixlang's own when the template writes no calls or its calls cannot be read, "
            "with a warning), template reads it or refuses to start, or a named format"),
    Setting("engine", "check_integrity_every_step", BOOL, False,
            "check the block pool's and the radix cache's invariants after every step (slow; "
            "for debugging)"),
)  # fmt: skip
SERVER_SETTINGS = (
    Setting("server", "host", TEXT, "127.0.0.1", "address to listen on"),
    Setting("server", "port", PORT, 30000, "port to listen on"),
    Setting("server", "api_key", TEXT, None,
            "require 'Authorization: Bearer KEY' (default: $RADIXLANG_API_KEY)", "KEY"),
    Setting("server", "api_keys_file", TEXT, None,
            "a JSON or TOML file mapping API keys to tenant names: requests need one of the "
            "keys, and tenants never share cached prefixes", "FILE"),
    Setting("server", "served_model_name", TEXT, None,
            "the model name clients use (default: the model's)", "NAME"),
    Setting("server", "max_queued_requests", POSITIVE_INT, None,
            "answer 503 (Retry-After: 1) rather than queue more than this many requests"),
    Setting("server", "allowed_origins", ORIGINS, None,
            "origins whose browser pages may call the API (CORS), e.g. http://localhost:3000"),
    Setting("server", "drain_timeout", SECONDS, 30.0,
            "seconds to let requests in flight finish on shutdown before aborting them"),
    Setting("server", "log_level", _choice_kind(LOG_LEVELS), "info", "the server's log level"),
    Setting("server", "dashboard", BOOL, True,
            "serve the live dashboard at /dashboard (--no-dashboard: off)"),
    Setting("server", "dashboard_interval", POSITIVE_SECONDS, 1.0,
            "seconds between the dashboard's live snapshots"),
    Setting("server", "dashboard_max_nodes", POSITIVE_INT, 150,
            "the dashboard draws the radix tree's N largest nodes"),
    Setting("server", "replicas", POSITIVE_INT, 1,
            "engines behind the endpoint; more than 1 runs them as Ray actors (the ray extra)"),
    Setting("server", "ray_address", TEXT, None,
            "join this Ray cluster for the replicas (default: start a local Ray)"),
    Setting("server", "routing", _choice_kind(ROUTING_POLICIES), "cache_aware",
            "how requests are spread over replicas: by cached prefix and load, or in turn"),
    Setting("server", "cpus_per_replica", POSITIVE_INT, None,
            "CPUs (and torch threads) per replica (default: the cluster's CPUs shared out)"),
)  # fmt: skip
# The settings that shape the replica set rather than the HTTP app.
CLUSTER_KEYS = ("replicas", "ray_address", "routing", "cpus_per_replica")
SETTINGS = {s.name: s for s in (*ENGINE_SETTINGS, *SERVER_SETTINGS)}


# ---- the engine's settings as one object ---------------------------------------------------
class _CheckedOnCreation:
    def __post_init__(self) -> None:
        for s in ENGINE_SETTINGS:
            object.__setattr__(self, s.key, s.check_python(getattr(self, s.key)))


# Everything an Engine is made with: one field per [engine] setting (its key, its default; None:
# the engine decides, as each setting's help says), checked when made. The file's [engine]
# table, the command line's flags and Engine(**kwargs) all build one.
EngineConfig = make_dataclass(
    "EngineConfig",
    [(s.key, Any, field(default=s.default)) for s in ENGINE_SETTINGS],
    bases=(_CheckedOnCreation,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "An engine's settings: one field per ``ENGINE_SETTINGS`` row (key, default, "
        "help), each checked when the config is made (a ``ValueError`` names the key).",
    },
)


# ---- the configuration ---------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """The effective settings (``values``, by ``section.key``; None where unset), which of them
    a file or a flag gave (``given``), and the file read, if any."""

    values: Mapping[str, Any]
    given: frozenset[str] = frozenset()
    source: Path | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def section(self, section: str) -> dict[str, Any]:
        return {s.key: self.values[s.name] for s in SETTINGS.values() if s.section == section}

    def engine_kwargs(self, only_given: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``Engine`` (and ``Runtime``): every setting that has a value,
        or with ``only_given`` only those a file or a flag gave."""
        kwargs = {
            key: value
            for key, value in self.section("engine").items()
            if value is not None and (not only_given or f"engine.{key}" in self.given)
        }
        return kwargs

    def engine_config(self) -> Any:
        """The engine settings as an :data:`EngineConfig` (what ``Engine(config=...)`` takes)."""
        return EngineConfig(**self.engine_kwargs())

    def server_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``radixlang.server.app.serve`` (after the engine)."""
        kwargs = self.section("server")
        origins = kwargs["allowed_origins"]
        kwargs["allowed_origins"] = list(origins) if origins else None
        return kwargs

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {
            section: {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.section(section).items()
            }
            for section in SECTIONS
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def to_toml(self) -> str:
        """The settings as a TOML file that :func:`load_config` reads back to the same values;
        unset ones are comments."""
        lines = ["# radixlang configuration: radixlang CMD --config FILE"]
        if self.source is not None:
            lines.append(f"# from {self.source}, then flags, then defaults")
        for section, settings in (("engine", ENGINE_SETTINGS), ("server", SERVER_SETTINGS)):
            lines += ["", f"[{section}]"]
            for s in settings:
                value = self.values[s.name]
                if value is None:
                    lines.append(f"# {s.key}: unset; {s.help}")
                else:
                    lines.append(f"{s.key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are TOML's too
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's settings by ``section.key``, each checked; a bad one is a ``ConfigError``."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} could not be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return check_values(data, where=str(path))


def check_values(data: Mapping[str, Any], where: str = "config") -> dict[str, Any]:
    """Settings by ``section.key`` from TOML's nested tables, each key and value checked."""
    values: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            homes = [s.section for s in SETTINGS.values() if s.key == section]
            if homes:  # a setting outside its table
                hint = f": put it in the [{homes[0]}] table"
            else:
                hint = did_you_mean(section, SECTIONS) or ": the tables are [engine], [server]"
            raise ConfigError(f"{where}: unknown key or table {section!r}{hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section!r} must be a table ([{section}])")
        keys = [s.key for s in SETTINGS.values() if s.section == section]
        for key, value in table.items():
            name = f"{section}.{key}"
            setting = SETTINGS.get(name)
            if setting is None:
                raise ConfigError(f"{where}: unknown key {name!r}{did_you_mean(key, keys)}")
            try:
                values[name] = setting.kind.check(value)
            except ValueError:
                raise ConfigError(
                    f"{where}: {name} must be {setting.kind.description}, got {value!r}"
                ) from None
    if "engine.kv_memory" in values and "engine.num_blocks" in values:
        raise ConfigError(f"{where}: give engine.kv_memory or engine.num_blocks, not both")
    return values


def resolve(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> dict[str, Any]:
    """Flags over the file over the defaults. kv_memory and num_blocks size the same pool, so
    a flag for one of them drops the file's other."""
    if "engine.kv_memory" in flag_values and "engine.num_blocks" in flag_values:
        raise ConfigError("give --kv-memory or --num-blocks, not both")
    file_values = dict(file_values)
    for flag, other in (("kv_memory", "num_blocks"), ("num_blocks", "kv_memory")):
        if f"engine.{flag}" in flag_values:
            file_values.pop(f"engine.{other}", None)
    values = {name: s.default for name, s in SETTINGS.items()}
    values.update(file_values)
    values.update(flag_values)
    if values["engine.kv_memory"] is None and values["engine.num_blocks"] is None:
        values["engine.kv_memory"] = DEFAULT_KV_MEMORY
    return values


def config_path(path: str | Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """``--config``'s file, else ``$RADIXLANG_CONFIG``'s, else None."""
    if path is not None:
        return Path(path)
    from_env = environ.get(CONFIG_ENV, "").strip()
    if from_env:
        if not Path(from_env).is_file():
            raise ConfigError(f"${CONFIG_ENV} names {from_env!r}, which is not a file")
        return Path(from_env)
    return None


def load_config(
    path: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """The effective configuration: ``flags`` (by ``section.key``, only those given) over the
    file at ``path`` (or ``$RADIXLANG_CONFIG``'s) over the defaults."""
    flag_values = dict(flags or {})
    for name in flag_values:
        if name not in SETTINGS:
            raise ConfigError(f"unknown setting {name!r}{did_you_mean(name, list(SETTINGS))}")
    source = config_path(path, environ)
    file_values = read_config_file(source) if source is not None else {}
    values = resolve(file_values, flag_values)
    return Config(values, frozenset(file_values) | frozenset(flag_values), source)


# ---- flags ---------------------------------------------------------------------------------
def _flag_type(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return setting.kind.parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {setting.kind.description}, got {text!r}"
            ) from None

    parse.__name__ = setting.key  # argparse names the type in some messages
    return parse


def _dest(setting: Setting) -> str:
    return f"{setting.section}__{setting.key}"


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"a TOML file with [engine] and [server] tables (default: ${CONFIG_ENV})",
    )


def add_setting_arguments(
    parser: argparse.ArgumentParser, settings: Sequence[Setting], title: str
) -> None:
    """One flag per setting; each defaults to None, so an absent flag leaves the file's value."""
    group = parser.add_argument_group(title)
    for s in settings:
        default = "" if s.default is None else f" (default: {s.default})"
        metavar = s.metavar or s.kind.metavar or s.key.upper()
        if s.kind.choices:
            metavar = "{" + ",".join(s.kind.choices) + "}"
        kwargs: dict[str, Any] = {"dest": _dest(s), "default": None, "type": _flag_type(s)}
        if s.kind is BOOL:
            flag = argparse.BooleanOptionalAction
            group.add_argument(s.flag, *s.aliases, dest=_dest(s), default=None, action=flag,
                               help=s.help + default)  # fmt: skip
            continue
        if s.kind is ORIGINS:
            kwargs["nargs"] = "+"
            metavar = "ORIGIN"
        group.add_argument(s.flag, *s.aliases, metavar=metavar, help=s.help + default, **kwargs)


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """The engine's flags, less the keys in ``exclude`` (a command that has its own)."""
    settings = [s for s in ENGINE_SETTINGS if s.key not in exclude]
    add_setting_arguments(parser, settings, "engine (flags override the config file)")


def add_server_arguments(
    parser: argparse.ArgumentParser, settings: Sequence[Setting] = SERVER_SETTINGS
) -> None:
    add_setting_arguments(parser, settings, "server (flags override the config file)")


def flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings whose flags were given, by ``section.key``."""
    given = {}
    for s in SETTINGS.values():
        value = getattr(args, _dest(s), None)
        if value is not None:
            given[s.name] = tuple(value) if s.kind is ORIGINS else value
    return given


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Config:
    """The configuration of a command parsed with the flags added above."""
    return load_config(getattr(args, "config", None), flags_given(args), environ)
