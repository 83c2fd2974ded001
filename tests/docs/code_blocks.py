"""The fenced code blocks of a Markdown page, and what the docs tests do with each.

The convention (README.md and docs/**/*.md; tests/docs/test_code_blocks.py enforces it):

- ```` ```python ```` blocks run, in order, in one namespace per page (a page reads as one
  session), in a fresh temporary folder, with the repository root on ``sys.path``; the default
  model is a tiny random one there (tests/docs/tiny_model_hook/).
- ```` ```bash ````, ```` ```console ````, ```` ```sh ```` and ```` ```shell ```` blocks run with
  ``bash -e`` from the repository root, the venv's ``bin`` first on ``PATH``; each must exit 0.
- A block whose nearest non-blank line above is ``<!-- not run: REASON -->`` (a reason is
  required) is not run.
- A block whose nearest non-blank line above is ``<!-- output -->`` is the expected standard
  output of the block just before it on the page, which must be one that runs. Lines are
  compared with trailing whitespace stripped, leading and trailing blank lines ignored.
- Any other block (toml, text, json, mermaid, no language, ...) needs a ``not run`` marker.

Blocks inside list items are indented: a block's lines lose its fence's indentation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PYTHON = ("python", "py", "python3")
SHELL = ("bash", "console", "sh", "shell")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_COMMENT = re.compile(r"^<!--(?P<body>.*?)-->$")
_NOT_RUN = re.compile(r"^\s*not[ -]run\b(?P<colon>\s*:)?(?P<reason>.*)$", re.IGNORECASE)
_OUTPUT = re.compile(r"^\s*output\s*$", re.IGNORECASE)


class MarkerError(ValueError):
    """A marker that does not follow the convention (a ``not run`` without a reason...)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: ``line`` is its opening fence's (1-based), ``code`` its dedented text."""

    page: str
    line: int
    lang: str  # the info string's first word, lowercased ("" for none)
    code: str
    not_run: str | None = None  # the reason of a ``not run`` marker
    output: bool = False  # an ``<!-- output -->`` block: the previous block's expected output

    @property
    def runs(self) -> bool:
        return self.not_run is None and not self.output and self.lang in PYTHON + SHELL

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")

    @property
    def where(self) -> str:
        """Page, line and first line, for failure messages."""
        return f"{self.page}:{self.line} (```{self.lang} block starting {self.first_line!r})"


def _marker(line: str, page: str, number: int) -> tuple[str | None, bool]:
    """(not-run reason, is output) of a marker line, (None, False) for any other line."""
    m = _COMMENT.match(line.strip())
    if not m:
        return None, False
    body = m.group("body")
    if _OUTPUT.match(body):
        return None, True
    nr = _NOT_RUN.match(body)
    if nr is None:
        return None, False
    reason = nr.group("reason").strip()
    if not nr.group("colon") or not reason:
        raise MarkerError(
            f"{page}:{number}: a not-run marker needs a reason: <!-- not run: why -->, got "
            f"{line.strip()!r}"
        )
    return reason, False


def _dedent(lines: list[str], indent: str) -> str:
    """The block's lines less the fence's indentation (where a line has it)."""
    width = len(indent.expandtabs(4))
    out = []
    for line in lines:
        expanded = line.expandtabs(4)
        lead = len(expanded) - len(expanded.lstrip(" "))
        out.append(expanded[min(lead, width) :])
    return "\n".join(out)


def parse(text: str, page: str = "<page>") -> list[Block]:
    """The fenced blocks of Markdown ``text``, with their markers (see the module's doc)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    last_text = ("", 0)  # the nearest non-blank line outside blocks, and its number
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            if lines[i].strip():
                last_text = (lines[i], i + 1)
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        info = m.group("info").strip()
        lang = info.split()[0].lower().lstrip(".{").rstrip("}") if info else ""
        start = i + 1
        j = start
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        reason, output = _marker(last_text[0], page, last_text[1])
        blocks.append(Block(page, start, lang, _dedent(lines[start:j], indent), reason, output))
        last_text = ("", 0)  # a marker above one block does not reach the next
        i = j + 1
    return blocks


def pair_outputs(blocks: list[Block]) -> list[tuple[Block, Block | None]]:
    """Each block that runs with its expected output block (or None); raises
    :class:`MarkerError` for an output block that follows no block that runs."""
    pairs: list[tuple[Block, Block | None]] = []
    previous: Block | None = None
    for block in blocks:
        if block.output:
            if previous is None or not previous.runs:
                raise MarkerError(
                    f"{block.where}: an <!-- output --> block must follow a block that runs "
                    "(python or bash, not marked not run), one output block each"
                )
            pairs[-1] = (previous, block)
        elif block.runs:
            pairs.append((block, None))
        previous = block
    return pairs


def unmarked(blocks: list[Block]) -> list[Block]:
    """Blocks that neither run nor carry a marker: each one is a failure."""
    return [b for b in blocks if not b.runs and b.not_run is None and not b.output]


def normalize_output(text: str) -> str:
    """Output as compared: trailing whitespace of each line and outer blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def pages(root: Path) -> list[Path]:
    """README.md and every docs/**/*.md but docs/gen/ (the generators' folder)."""
    docs = root / "docs"
    found = [p for p in sorted(docs.rglob("*.md")) if "gen" not in p.relative_to(docs).parts[:1]]
    return [root / "README.md", *found]
