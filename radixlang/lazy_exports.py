"""Package attributes that import their module on first use (PEP 562), so that importing a
package stays light: ``radixlang.runtime.Engine`` loads torch and transformers only when asked.

A leaf: it imports only the standard library, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose ``exports`` map a public name to
    the module (full dotted name) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        package_globals = vars(importlib.import_module(package))
        return sorted(set(package_globals) | set(exports))

    return __getattr__, __dir__
