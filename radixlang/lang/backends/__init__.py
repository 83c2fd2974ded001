"""Where a program's generation calls go: the local engine, a radixlang/SGLang server
(``RuntimeEndpoint``), or an OpenAI-compatible service (``OpenAI``).

Imported on first use: the local backend loads torch and the engine, the HTTP ones httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Backend": "radixlang.backends.base",
    "LocalBackend": "radixlang.backends.local",
    "Runtime": "radixlang.backends.local",
    "RuntimeEndpoint": "radixlang.backends.endpoint",
    "EndpointError": "radixlang.backends.endpoint",
    "OpenAI": "radixlang.backends.openai",
    "OpenAIError": "radixlang.backends.openai",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlang.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
