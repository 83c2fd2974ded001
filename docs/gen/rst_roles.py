"""A griffe extension for the API reference (mkdocs.yml): the docstrings' reST roles
(``:class:`~radixlang.x.Y```, ``:meth:`name <target>```) as Markdown code (`Y`, `name`). The
rest of their markup (````literal````, plain prose) is Markdown already."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?[a-z]+:`(?P<body>[^`]+)`")


def _code(m: re.Match[str]) -> str:
    body = m.group("body").strip()
    named = re.fullmatch(r"(?P<text>.+?)\s*<[^>]+>", body)
    if named:
        return f"`{named.group('text')}`"
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return f"`{body}`"


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
