"""Where a program's generation calls go: the local engine (``Runtime``), a radixlang/SGLang
server (``RuntimeEndpoint``), or an OpenAI-compatible service (``OpenAI``).

The one door from the language to the engine: only ``local.py`` imports ``radixlang.runtime``;
the HTTP backends speak to a server over httpx and import neither the runtime nor the server.
Each loads on first use: the local backend brings torch and the engine, the HTTP ones httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlang.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from radixlang.lang.backends.base import Backend
    from radixlang.lang.backends.endpoint import EndpointError, RuntimeEndpoint
    from radixlang.lang.backends.local import LocalBackend, Runtime
    from radixlang.lang.backends.openai import OpenAI, OpenAIError

_EXPORTS = {
    "Backend": "radixlang.lang.backends.base",
    "LocalBackend": "radixlang.lang.backends.local",
    "Runtime": "radixlang.lang.backends.local",
    "RuntimeEndpoint": "radixlang.lang.backends.endpoint",
    "EndpointError": "radixlang.lang.backends.endpoint",
    "OpenAI": "radixlang.lang.backends.openai",
    "OpenAIError": "radixlang.lang.backends.openai",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "Backend",
    "EndpointError",
    "LocalBackend",
    "OpenAI",
    "OpenAIError",
    "Runtime",
    "RuntimeEndpoint",
]
