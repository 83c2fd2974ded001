"""Markdown helpers of the generated reference pages (docs/gen/*.py)."""

from __future__ import annotations

import re
from collections.abc import Callable


def text(prose: str) -> str:
    """Help prose as Markdown text: one line, and what Markdown would read as emphasis, HTML or
    a link escaped (``__main__`` stays ``__main__``); `backticks` stay code."""
    parts = " ".join(prose.split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = re.sub(r"([\\*_\[\]])", r"\\\1", parts[i]).replace("<", "&lt;")
    return "`".join(parts)


def cell(prose: str) -> str:
    """``prose`` as one table cell."""
    return text(prose).replace("|", "\\|")


def code(literal: str) -> str:
    """``literal`` as inline code in a table cell (empty stays empty)."""
    return f"`{literal}`".replace("|", "\\|") if literal else ""


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines; cells are given as Markdown already."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def write_page(path: str, render: Callable[[], str], as_script: bool) -> None:
    """A generated page: printed when its script runs by itself, else written into the site
    (mkdocs-gen-files, at build time)."""
    if as_script:
        print(render(), end="")
        return
    import mkdocs_gen_files

    with mkdocs_gen_files.open(path, "w") as f:
        f.write(render())
