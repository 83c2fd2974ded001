"""Where each short run of tokens (an n-gram) last occurred in one growing token sequence, to
draft what followed it (prompt lookup decoding).

The index covers the n-grams that end before the sequence's last token, so that the run ending
at the last token (the suffix being matched) finds an earlier occurrence, never itself. It is
brought up to date lazily, when a draft is asked for, at a few dictionary inserts per token.
Keys are the n-grams' hashes, not the tuples (a third of the memory; a collision only makes a
wrong draft, which verification rejects).
"""

from __future__ import annotations

from collections.abc import Sequence

# Suffixes of these lengths are matched, longest first (a match of one token predicts little,
# which the drafter's acceptance estimates per match length account for).
MIN_NGRAM = 1
MAX_NGRAM = 5


class NgramIndex:
    """The n-grams (``MIN_NGRAM`` .. ``MAX_NGRAM`` tokens) of ``tokens`` (a list that only
    grows at its end, e.g. a request's prompt and output), each with the position after its
    latest occurrence."""

    __slots__ = ("_seen", "indexed", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self._seen: dict[int, int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def update(self) -> None:
        """Index the n-grams that end before the last token (a token still being sampled, a
        negative placeholder, ends the part indexed)."""
        tokens = self.tokens
        end = len(tokens) - 1
        while end > self.indexed and tokens[end - 1] < 0:
            end -= 1
        start = self.indexed
        if end <= start:
            return
        seen = self._seen
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            first = max(start, n)  # the first position after an n-gram to add
            if first > end:
                continue
            window = tokens[first - n : end]
            # n-grams ending at first-1 .. end-1, each mapped to the position after it.
            grams = zip(*(window[j:] for j in range(n)), strict=False)
            seen.update(zip(map(hash, grams), range(first, end + 1), strict=False))
        self.indexed = end

    def find(self, suffix: Sequence[int]) -> tuple[int, int]:
        """``(n, position)``: the longest ``n`` for which the last ``n`` tokens of ``suffix``
        occurred in the indexed part, and the position after that occurrence; ``(0, -1)``
        when none did."""
        seen = self._seen
        for n in range(min(MAX_NGRAM, len(suffix)), MIN_NGRAM - 1, -1):
            at = seen.get(hash(tuple(suffix[len(suffix) - n :])))
            if at is not None:
                return n, at
        return 0, -1

    def continuation(self, at: int, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens from ``at`` on (stopping before a placeholder)."""
        out = self.tokens[at : at + max_tokens]
        for i, token in enumerate(out):
            if token < 0:
                return out[:i]
        return out
