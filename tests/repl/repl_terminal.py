"""Drive ``python -m radixlang.repl`` through a real pseudo-terminal, as a person types.

prompt_toolkit needs a terminal it can draw in: ``TERM=xterm-256color``, a fixed size, and no
cursor-position requests (``PROMPT_TOOLKIT_NO_CPR=1``: nothing in a test answers them, and
prompt_toolkit would wait for the answer). Keys are sent as a terminal sends them (Enter is
``\\r``). The prompt redraws the typed line when Enter is pressed, so a command's turn is over
only when its own output has appeared and a fresh prompt follows it: ``command`` waits for
both. ``screen`` is everything printed, with the terminal's control sequences removed.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from pathlib import Path

import pexpect

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "radixlang>"
# CSI and OSC sequences, other escapes, and control characters except tab and newline.
CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[@-_]|[\x00-\x08\x0b-\x1f]")
USAGE = re.compile(
    r"(\d+) prompt tokens: (\d+) from the cache, (\d+) computed · (\d+) generated · (\w+)"
)


def clean(text: str) -> str:
    return CONTROL.sub("", text)


def _interruptible() -> None:
    """In the child: Ctrl-C raises SIGINT there, as under a person's shell. A process that
    starts with SIGINT ignored (inherited from a test process some earlier test left ignoring
    it, or a background job) never gets KeyboardInterrupt, and Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ReplTerminal:
    def __init__(self, args: list[str], home: Path, timeout: float = 120.0) -> None:
        env = dict(os.environ)
        env.update(TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", XDG_CACHE_HOME=str(home))
        # The terminal's size is the pty's: pytest-xdist sets COLUMNS=80 in its workers, which
        # rich would take over the pty's 160 columns.
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        self.log = io.StringIO()
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "radixlang.repl", *args],
            cwd=str(ROOT),
            env=env,
            encoding="utf-8",
            codec_errors="replace",
            dimensions=(50, 160),
            timeout=timeout,
            preexec_fn=_interruptible,
        )
        self.child.logfile_read = self.log
        self.child.expect_exact(PROMPT)

    def mark(self) -> int:
        return len(self.log.getvalue())

    def screen(self, since: int = 0) -> str:
        return clean(self.log.getvalue()[since:])

    def type(self, line: str) -> None:
        self.child.send(line + "\r")

    def expect(self, *texts: str) -> None:
        """Wait for each text in turn (each must be printed in one style)."""
        for text in texts:
            self.child.expect_exact(text)

    def command(self, line: str, *texts: str) -> str:
        """Type ``line``, wait for ``texts`` and the next prompt; the screen text in between."""
        start = self.mark()
        self.type(line)
        self.expect(*texts)
        self.child.expect_exact(PROMPT)
        return self.screen(start)

    def exit_with_ctrl_d(self) -> int:
        self.child.sendcontrol("d")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


def usages(screen: str) -> list[tuple[int, int, int, int, str]]:
    """Every usage line on the screen: (prompt, from the cache, computed, generated, finish)."""
    return [(int(a), int(b), int(c), int(d), e) for a, b, c, d, e in USAGE.findall(screen)]


TREE_NODE = re.compile(r"^((?:[│ ] {3})*)[├└]── (.*?)  (\d+) tok · (\d+) blk")


def tree_nodes(screen: str) -> list[tuple[int, int, str]]:
    """The /tree drawing's nodes, in order: (depth from 0, tokens, edge text)."""
    drawing = screen[screen.rindex("radix cache:") :]
    out = []
    for line in drawing.splitlines():
        m = TREE_NODE.match(line)
        if m:
            out.append((len(m.group(1)) // 4, int(m.group(3)), m.group(2)))
    return out


def leaves(nodes: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The nodes no other node hangs from (the next node is not deeper)."""
    return [n for i, n in enumerate(nodes) if i + 1 == len(nodes) or nodes[i + 1][0] <= n[0]]
