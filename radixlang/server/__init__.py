"""The HTTP service over one engine: SGLang's native ``/generate``, the OpenAI API, operations
routes and Prometheus metrics (FastAPI on uvicorn).

It may import ``radixlang.runtime`` (and ``radixlang.version``); never ``radixlang.lang``: a
program reaches a server through ``lang/backends``, over HTTP. ``serve`` and
``serve_in_thread`` load FastAPI and the engine on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlang.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from radixlang.server.app import ServerThread, create_app, serve, serve_in_thread

_EXPORTS = {
    "ServerThread": "radixlang.server.app",
    "create_app": "radixlang.server.app",
    "serve": "radixlang.server.app",
    "serve_in_thread": "radixlang.server.app",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "ServerThread",
    "create_app",
    "serve",
    "serve_in_thread",
]
