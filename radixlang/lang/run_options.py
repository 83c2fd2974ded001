"""What a program run is given besides its arguments: the backend (the default one unless
``backend=`` is passed) and the sampling defaults from ``run``'s keywords."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.ir import SamplingDefaults

_SAMPLING_KWARGS = {f.name for f in dataclasses.fields(SamplingDefaults)}
# SGLang's run() keywords that mean nothing here (one completion per gen; states run on threads).
_IGNORED_KWARGS = {"use_thread", "return_text_in_logprobs", "stop_regex"}

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


# Engine settings that every Runtime() made inside ``runtime_defaults`` takes for what it does not
# pass itself, and the Runtimes made there: `radixlang run` uses them so that a program that makes
# its own Runtime runs on the command's --config and flags, and its cache is reported at the end.
_runtime_defaults: dict[str, Any] = {}
_runtimes_made: list[Backend] | None = None


@contextlib.contextmanager
def runtime_defaults(engine_args: dict[str, Any]) -> Iterator[list[Backend]]:
    """Within the block, ``Runtime(...)`` takes ``engine_args`` (Engine keyword arguments) for
    what it is not given; yields the list of the Runtimes made in the block."""
    global _runtime_defaults, _runtimes_made
    saved = _runtime_defaults, _runtimes_made
    _runtime_defaults, _runtimes_made = dict(engine_args), []
    try:
        yield _runtimes_made
    finally:
        _runtime_defaults, _runtimes_made = saved


def with_runtime_defaults(engine_args: dict[str, Any]) -> dict[str, Any]:
    """A Runtime's engine arguments over the defaults in force (see ``runtime_defaults``)."""
    return {**_runtime_defaults, **engine_args}


def runtime_made(runtime: Backend) -> None:
    if _runtimes_made is not None:
        _runtimes_made.append(runtime)


def resolve_backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: pass backend=..., or call radixlang.set_default_backend(Runtime())"
        )
    return backend


def split_run_kwargs(
    kwargs: dict[str, Any], arg_names: Sequence[str] = ()
) -> tuple[SamplingDefaults, dict[str, Any]]:
    """(the run's sampling defaults, the program's own arguments) from ``run``'s keywords. A
    keyword the program declares (say ``temperature``) goes to the program."""
    own = set(arg_names)
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_KWARGS and k not in own}
    for k in _IGNORED_KWARGS & kwargs.keys() - own:
        kwargs.pop(k)
    if "n" not in own and kwargs.pop("n", 1) != 1:
        raise ValueError("run(n=...) is not supported: use gen(..., n=k) or s.fork(k)")
    if sampling.get("stop") is None:
        sampling.pop("stop", None)
    if sampling.get("stop_token_ids") is None:
        sampling.pop("stop_token_ids", None)
    return SamplingDefaults(**sampling), kwargs
