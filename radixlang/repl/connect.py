"""Opening the REPL's backend: a server (``--url``) or an engine in this process. Apart from
:mod:`radixlang.repl.backends` (the interface both implement), so the interface imports
neither implementation."""

from __future__ import annotations

from typing import Any

from radixlang.repl.backends import ChatBackend


def open_backend(args: Any, config: Any) -> ChatBackend:
    """The backend ``args`` ask for: ``--url`` a server, else a local engine on ``--model``
    with ``config.engine_kwargs()`` (None: the engine's defaults)."""
    if getattr(args, "url", None):
        from radixlang.repl.remote import RemoteChat  # httpx only: no torch

        return RemoteChat(args.url, api_key=getattr(args, "api_key", None))
    from radixlang.repl.local import LocalChat

    kwargs = dict(config.engine_kwargs()) if config is not None else {}
    if getattr(args, "model", None):
        kwargs["model"] = args.model
    return LocalChat.start(**kwargs)
