"""The conversation as a tree of turns: every reply ever sampled stays, and one path is active.

A user turn's children are its replies (one per chat turn, more after ``/fork``); a reply's
children are the next user turns (more than one after ``/back`` and a new message). The active
path, root to ``current``, is what the next turn sends. ``/pick K`` moves ``current`` to the
K-th reply of the last user turn; ``/back`` moves it to before that user turn; nothing is
deleted, so a saved transcript holds every branch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

TRANSCRIPT_VERSION = 1


class SessionError(ValueError):
    """A branching command that does not apply here (nothing to undo, no such branch)."""


@dataclass(frozen=True)
class Usage:
    """What one generation cost: its prompt's tokens, how many of them the cache held."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
        }


@dataclass(eq=False)
class Turn:
    id: int
    role: str  # "root" (the tree's top, no content), "user" or "assistant"
    content: str
    parent: Turn | None = None
    children: list[Turn] = field(default_factory=list)
    usage: Usage | None = None  # a reply's

    def replies(self) -> list[Turn]:
        return [c for c in self.children if c.role == "assistant"]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "role": self.role, "content": self.content}
        if self.usage is not None:
            out["usage"] = self.usage.as_dict()
        out["children"] = [c.to_json() for c in self.children]
        return out


class Conversation:
    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self._ids = itertools.count()
        self.root = Turn(next(self._ids), "root", "")
        self.current = self.root

    # ---- reading -------------------------------------------------------------------------
    def path(self) -> list[Turn]:
        """The active turns, first to last (the root left out)."""
        out = []
        turn: Turn | None = self.current
        while turn is not None and turn is not self.root:
            out.append(turn)
            turn = turn.parent
        return out[::-1]

    def messages(self, upto: Turn | None = None) -> list[dict[str, str]]:
        """OpenAI-format messages of the active path (through ``upto``), system first."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.path():
            out.append({"role": turn.role, "content": turn.content})
            if turn is upto:
                break
        return out

    def last_user(self) -> Turn | None:
        """The active path's last user turn: the one a fork re-samples."""
        for turn in reversed(self.path()):
            if turn.role == "user":
                return turn
        return None

    def branches(self) -> tuple[Turn | None, list[Turn]]:
        """(the last user turn, its replies in the order they were sampled)."""
        user = self.last_user()
        return user, (user.replies() if user is not None else [])

    def branch_number(self, reply: Turn) -> int:
        """A reply's 1-based number among its user turn's replies (what /pick takes)."""
        assert reply.parent is not None
        return reply.parent.replies().index(reply) + 1

    def all_turns(self) -> list[Turn]:
        out, stack = [], [self.root]
        while stack:
            turn = stack.pop()
            out.append(turn)
            stack.extend(reversed(turn.children))
        return out

    # ---- changing ------------------------------------------------------------------------
    def add_user(self, content: str) -> Turn:
        """A new user turn after ``current`` (a new branch when ``current`` has a next turn)."""
        if self.current.role == "user":
            raise SessionError("the last user turn has no reply yet")
        turn = self._child(self.current, "user", content)
        self.current = turn
        return turn

    def add_reply(self, user: Turn, content: str, usage: Usage | None = None) -> Turn:
        """A reply to ``user`` (one more branch if it has replies); ``current`` is unchanged."""
        if user.role != "user":
            raise SessionError("a reply must answer a user turn")
        turn = self._child(user, "assistant", content)
        turn.usage = usage
        return turn

    def discard(self, turn: Turn) -> None:
        """Remove a turn that never got what it needed (a user turn whose reply failed)."""
        if turn.children:
            raise SessionError("only a turn with nothing after it can be discarded")
        parent = turn.parent
        assert parent is not None
        parent.children.remove(turn)
        if self.current is turn:
            self.current = parent

    def select(self, turn: Turn) -> None:
        self.current = turn

    def pick(self, number: int) -> Turn:
        """Continue from reply ``number`` (1-based) of the last user turn."""
        user, replies = self.branches()
        if user is None or not replies:
            raise SessionError("no branches yet: send a message, then /fork N")
        if not 1 <= number <= len(replies):
            raise SessionError(f"no branch {number}: pick 1 to {len(replies)}")
        self.current = replies[number - 1]
        return self.current

    def back(self) -> Turn:
        """Undo the last turn (a user message and its reply): the active path ends before it.
        The undone turns stay in the tree. Returns the user turn undone."""
        user = self.last_user()
        if user is None:
            raise SessionError("nothing to undo")
        assert user.parent is not None
        self.current = user.parent
        return user

    # ---- saving --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The transcript: the active ``messages`` and the whole ``tree`` of turns (every
        branch, each reply with its token usage), ``current`` naming the active path's end."""
        return {
            "version": TRANSCRIPT_VERSION,
            "system": self.system,
            "messages": self.messages(),
            "current": self.current.id,
            "tree": self.root.to_json(),
        }

    def _child(self, parent: Turn, role: str, content: str) -> Turn:
        turn = Turn(next(self._ids), role, content, parent)
        parent.children.append(turn)
        return turn
