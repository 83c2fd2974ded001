"""The default model as a tiny random one, for the code blocks of the docs (tests/docs/).

``use_tiny_default(folder)`` makes ``load_model_files`` give the model in ``folder`` (written by
``radixlang.testing.write_tiny_chat_model``: the default model's tokenizer and chat template,
random weights) wherever the default model's name is asked for: ``Engine()``, ``Runtime()``,
``radixlang generate`` with no ``--model``, ``--model smollm2-135m-instruct``. It keeps the
default model's name, so what a page prints names the model it documents. Every other name or
path loads as usual, and everything after the lookup (tokenizer, weights, engine) is the real
code's.

The test process calls it; the shell blocks' Python processes import this file as
``sitecustomize`` (its folder first on ``PYTHONPATH``), which calls it with
``$RADIXLANG_DOCS_TINY_MODEL``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

ENV = "RADIXLANG_DOCS_TINY_MODEL"


def use_tiny_default(
    folder: str | os.PathLike[str], setattr: Callable[[Any, str, Any], None] = setattr
) -> None:
    """Swap the default model for the one in ``folder``; ``setattr`` (pytest's
    ``monkeypatch.setattr``) undoes it after a test."""
    import radixlang.model_files as model_files

    real = getattr(model_files.load_model_files, "__wrapped__", model_files.load_model_files)
    tiny = os.fspath(folder)

    def load_model_files(
        name_or_path: str | os.PathLike[str] = model_files.DEFAULT_MODEL, keep_gguf: bool = False
    ) -> Any:
        if os.fspath(name_or_path) == model_files.DEFAULT_MODEL:
            return dataclasses.replace(real(tiny), name=model_files.DEFAULT_MODEL)
        return real(name_or_path, keep_gguf=keep_gguf)

    load_model_files.__wrapped__ = real  # type: ignore[attr-defined]
    # The module, and every module that imported the function by name before now (later
    # imports take it from the module).
    for name, module in list(sys.modules.items()):
        if name != "radixlang" and not name.startswith("radixlang."):
            continue
        held = getattr(module, "load_model_files", None)
        if held is real or getattr(held, "__wrapped__", None) is real:
            setattr(module, "load_model_files", load_model_files)


if os.environ.get(ENV):
    use_tiny_default(os.environ[ENV])
