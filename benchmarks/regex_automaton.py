"""The earlier regex automaton, kept as a peer for ``bench_grammar_engines.py`` (the engine
uses llguidance): which tokens may come next so that the output stays a match.

A :class:`RegexGuide` compiles a regex once, for one tokenizer, into interegular's finite
automaton over characters, and computes per automaton state (lazily, then cached) the mask of
tokens whose text can be read from that state without leaving the set of states from which a
match is still possible. The mask is found by walking the vocabulary's character trie together
with the automaton: a trie branch is cut as soon as its prefix kills the match, so a state that
allows only digits looks at a few dozen trie nodes, not at 49152 tokens.

EOS tokens are allowed exactly in accepting states (the text so far is a full match). A state
that accepts and that no token can continue allows only EOS, so generation ends cleanly.

A :class:`RegexConstraint` is one request's position in a guide: ``allowed_mask``,
``advance(token)``, ``is_finished``. Guides are shared through a small LRU
(:func:`get_regex_guide`), so a regex used by many requests is compiled once.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import interegular
import torch

from radixlang.constrain.errors import ConstraintError
from radixlang.constrain.vocabulary import TokenVocabulary, token_vocabulary

_GUIDE_CACHE_SIZE = 64
_SUPPORTED = (
    "literals, character classes, groups, alternation, repetition ({m,n} * + ?) and the "
    r"escapes \d \w \s"
)


@dataclass(frozen=True)
class StateMask:
    """What one automaton state allows."""

    mask: torch.Tensor  # bool [vocab_size]: tokens that may come next (EOS where accepting)
    accepting: bool  # the text so far is a full match
    can_continue: bool  # some non-EOS token is allowed


def compile_regex(regex: str) -> Any:
    """interegular's automaton for ``regex``; :class:`ConstraintError` if it cannot be built."""
    if not isinstance(regex, str):
        raise ConstraintError(f"regex must be a str, got {type(regex).__name__}")
    try:
        re.compile(regex)
    except re.error as e:
        raise ConstraintError(f"invalid regex {regex!r}: {e}") from None
    if _has_lookaround(regex):
        raise ConstraintError(
            f"regex {regex!r} uses a lookaround ((?=...), (?!...), (?<=...), (?<!...)), which "
            f"constrained decoding does not support; supported: {_SUPPORTED}"
        )
    try:
        return interegular.parse_pattern(regex).to_fsm()
    except Exception as e:  # interegular's Unsupported / InvalidSyntax, and anything it trips on
        detail = str(e) or type(e).__name__
        raise ConstraintError(
            f"regex {regex!r} is valid Python but uses syntax the regex-to-automaton compiler "
            f"(interegular) does not support ({detail}); anchors (^ $ \\b), backreferences and "
            f"unicode escapes are not supported; supported: {_SUPPORTED}"
        ) from None


def _has_lookaround(regex: str) -> bool:
    try:
        from re import _parser  # type: ignore[attr-defined]
    except ImportError:  # a Python without it: interegular decides alone
        return False

    def walk(node: object) -> bool:
        if isinstance(node, _parser.SubPattern):
            node = node.data
        if isinstance(node, list | tuple):
            if len(node) == 2 and str(node[0]) in ("ASSERT", "ASSERT_NOT"):
                return True
            return any(walk(x) for x in node)
        return False

    try:
        return walk(_parser.parse(regex))
    except Exception:
        return False


def _live_states(fsm: Any) -> set[int]:
    """States from which an accepting state can still be reached."""
    preds: dict[int, set[int]] = collections.defaultdict(set)
    for src, row in fsm.map.items():
        for dst in row.values():
            preds[dst].add(src)
    live = set(fsm.finals)
    todo = list(live)
    while todo:
        for p in preds[todo.pop()]:
            if p not in live:
                live.add(p)
                todo.append(p)
    return live


class RegexGuide:
    """A regex compiled for one tokenizer: per automaton state, the tokens that may come next.

    ``vocab_size`` is the width of the masks (the model's logits); ids the tokenizer does not
    have are never allowed. Masks are computed on first use of a state and then shared by every
    request using this guide; they must not be modified.
    """

    def __init__(
        self,
        regex: str,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
    ) -> None:
        fsm = compile_regex(regex)
        self.regex = regex
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size)
        self.vocab: TokenVocabulary = token_vocabulary(tokenizer, vocab_size)
        self._live = _live_states(fsm)
        if fsm.initial not in self._live:
            raise ConstraintError(f"regex {regex!r} matches no string")
        self.initial_state: int = fsm.initial
        self._finals = frozenset(fsm.finals)
        # Per state, the next live state for each character of the vocabulary that has one
        # (built lazily: characters that map to the same automaton symbol share a transition).
        self._fsm = fsm
        self._char_keys = {c: fsm.alphabet[c] for c in self.vocab.charset}
        self._rows: dict[int, dict[str, int]] = {}
        self._states: dict[int, StateMask] = {}
        self._lock = threading.Lock()
        self.eos_mask = _mask(vocab_size, self.eos_token_ids)
        first = self.state_mask(self.initial_state)
        if not first.can_continue and not first.accepting:
            raise ConstraintError(
                f"no token of the vocabulary can start a match of regex {regex!r} "
                f"(tokens that are partial UTF-8 characters or special are never used)"
            )

    @property
    def states(self) -> frozenset[int]:
        """The automaton's states from which a match is still possible."""
        return frozenset(self._live)

    def row(self, state: int) -> dict[str, int]:
        """Character -> next live state, for the characters of the vocabulary."""
        row = self._rows.get(state)
        if row is None:
            trans = {k: s for k, s in self._fsm.map.get(state, {}).items() if s in self._live}
            row = {}
            if trans:
                for c, key in self._char_keys.items():
                    nxt = trans.get(key)
                    if nxt is not None:
                        row[c] = nxt
            self._rows[state] = row
        return row

    def state_mask(self, state: int) -> StateMask:
        """The tokens allowed in ``state`` (computed on first use, then cached)."""
        info = self._states.get(state)
        if info is not None:
            return info
        with self._lock:
            info = self._states.get(state)
            if info is None:
                info = self._states[state] = self._build(state)
        return info

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after ``token_id``'s text, or None if the token kills the match."""
        text = self.vocab.text[token_id] if 0 <= token_id < self.vocab_size else None
        if text is None or token_id in self.eos_token_ids:
            return None
        for c in text:
            nxt = self.row(state).get(c)
            if nxt is None:
                return None
            state = nxt
        return state

    def _build(self, state: int) -> StateMask:
        allowed: list[int] = []
        stack = [(self.vocab.root, state)]
        while stack:
            node, st = stack.pop()
            row = self.row(st)
            if not row:
                continue
            children = node.children
            if len(row) < len(children):  # iterate the smaller side
                for c, nxt in row.items():
                    child = children.get(c)
                    if child is not None:
                        if child.tokens:
                            allowed += child.tokens
                        if child.children:
                            stack.append((child, nxt))
            else:
                for c, child in children.items():
                    nxt = row.get(c)
                    if nxt is not None:
                        if child.tokens:
                            allowed += child.tokens
                        if child.children:
                            stack.append((child, nxt))
        # EOS is never text: it ends a match or nothing. (Each token sits at one trie node, and
        # the walk reaches a node at most once, so ``allowed`` has no repeats.)
        eos = self.eos_token_ids
        can_continue = len(allowed) > sum(t in eos for t in allowed) if eos else bool(allowed)
        accepting = state in self._finals
        if eos:
            allowed = [t for t in allowed if t not in eos]
            if accepting:
                allowed += eos
        return StateMask(_mask(self.vocab_size, allowed), accepting, can_continue)

    def new_constraint(self) -> RegexConstraint:
        return RegexConstraint(self)


class RegexConstraint:
    """One request's progress through a :class:`RegexGuide` (a ``TokenConstraint``)."""

    def __init__(self, guide: RegexGuide) -> None:
        self.guide = guide
        self.state = guide.initial_state
        self.eos_taken = False

    def allowed_mask(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens that may come next (shared; do not modify)."""
        if self.eos_taken:
            return self.guide.eos_mask
        return self.guide.state_mask(self.state).mask

    def may_end(self) -> bool:
        """The text is a full match that could also go on: the engine may let the model pick
        any token, and one that cannot extend the match ends it (see :meth:`ends_on`), so
        ``[0-9]+`` stops at the model's newline instead of being forced into more digits."""
        if self.eos_taken:
            return False
        info = self.guide.state_mask(self.state)
        return info.accepting and info.can_continue

    def ends_on(self, token_id: int) -> bool:
        """The text is a full match and ``token_id`` cannot extend it: the match ends before
        that token, which the engine then drops."""
        if self.eos_taken or token_id in self.guide.eos_token_ids:
            return False
        info = self.guide.state_mask(self.state)
        return info.accepting and self.guide.next_state(self.state, token_id) is None

    def advance(self, token_id: int) -> None:
        """Take ``token_id``; :class:`ConstraintError` if the mask did not allow it."""
        if self.eos_taken:
            raise ConstraintError("the constraint is finished: an EOS token was already taken")
        info = self.guide.state_mask(self.state)
        if token_id in self.guide.eos_token_ids:
            if not info.accepting:
                raise ConstraintError(
                    f"EOS token {token_id} before the text matches regex {self.guide.regex!r}"
                )
            self.eos_taken = True
            return
        nxt = self.guide.next_state(self.state, token_id)
        if nxt is None:
            raise ConstraintError(
                f"token {token_id} ({self.guide.vocab.text[token_id]!r}) cannot continue a "
                f"match of regex {self.guide.regex!r}"
                if 0 <= token_id < self.guide.vocab_size
                else f"token {token_id} is outside the vocabulary [0, {self.guide.vocab_size})"
            )
        self.state = nxt

    def is_finished(self) -> bool:
        """An EOS was taken, or the text is a full match that no token can extend."""
        if self.eos_taken:
            return True
        info = self.guide.state_mask(self.state)
        return info.accepting and not info.can_continue


def _mask(size: int, ids: Iterable[int]) -> torch.Tensor:
    """A bool ``[size]`` tensor, True at ``ids``.

    Filled in a bytearray, not with torch ops: on a busy CPU each small torch op can wait
    milliseconds for its thread team (measured: 23-36 ms a mask against under 1 ms here).
    """
    buf = bytearray(size)
    for i in ids:
        buf[i] = 1
    return torch.frombuffer(buf, dtype=torch.bool)  # shares, and keeps alive, ``buf``


_guides: collections.OrderedDict[tuple[str, int, int, frozenset[int]], RegexGuide] = (
    collections.OrderedDict()
)
_guides_lock = threading.Lock()


def get_regex_guide(
    regex: str, tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: int
) -> RegexGuide:
    """The guide for ``regex`` on ``tokenizer``, from a small LRU (compiled on a miss)."""
    eos = frozenset(int(t) for t in eos_token_ids)
    key = (regex, id(tokenizer), vocab_size, eos)
    with _guides_lock:
        hit = _guides.get(key)
        # The guide holds its tokenizer, so an id in the cache is never a recycled one; the
        # identity check is belt and braces.
        if hit is not None and hit.tokenizer is tokenizer:
            _guides.move_to_end(key)
            return hit
    guide = RegexGuide(regex, tokenizer, eos, vocab_size)
    with _guides_lock:
        _guides[key] = guide
        while len(_guides) > _GUIDE_CACHE_SIZE:
            _guides.popitem(last=False)
    return guide


def clear_guide_cache() -> None:
    """Forget every cached guide."""
    with _guides_lock:
        _guides.clear()
