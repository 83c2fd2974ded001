"""Free text before a marker, without a mask per token: the ``auto`` tool-call grammar of a
format whose marker is plain text (``tool_calls.call_grammar``'s lazy form) lets the text be
anything that does not hold the marker, and from the marker on holds the calls.

In such text the grammar's mask is the same at every "clean" point: the text is not empty, no
marker was written, the text does not end with the start of the marker, and it ends on a whole
UTF-8 character. There any token that does not hold the whole marker is allowed exactly when
it was allowed after a reference text ("a"), and a token that holds it (a handful, found once
per grammar) is allowed exactly when the matcher validates it. So a clean point's mask is the
reference mask with those few tokens validated: about a microsecond instead of the 35 a full
mask costs with the default tokenizer (``benchmarks/bench_tool_masks.py``), and the same bits
(tests/constrain/test_free_text.py walks both side by side). Elsewhere (the start, where a
call may begin; after a possible start of the marker; in the calls) the matcher computes the
mask as for any grammar.

The matcher still takes every token (``consume_token`` costs about a microsecond): its state is
right whenever the full mask is needed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

_REFERENCE_TEXT = "a"


@dataclass
class FreeText:
    """One compiled grammar's free-text facts: its marker, the reference mask, the tokens that
    hold the marker, and every token's bytes (for tracking a request's text)."""

    marker: bytes
    reference: np.ndarray  # int32 words: the mask at a clean point, marker tokens cleared
    marker_tokens: list[int]  # tokens whose bytes hold the whole marker
    token_bytes: list[bytes] = field(repr=False, default_factory=list)
    unpacked: Any = field(repr=False, default=None)  # the reference as a bool tensor, once made

    @classmethod
    def build(cls, marker: str, template: object, ll_tokenizer: object) -> FreeText | None:
        """The facts for a grammar (``template``: its matcher at the start), or None where the
        reference text is not one token or is not a clean point of this grammar."""
        encoded = marker.encode()
        if encoded.startswith(_REFERENCE_TEXT.encode()[-1:]):
            return None  # the reference would end with the marker's start: not clean
        reference_ids = ll_tokenizer.tokenize_str(_REFERENCE_TEXT)  # type: ignore[attr-defined]
        if len(reference_ids) != 1:
            return None
        matcher = template.deep_copy()  # type: ignore[attr-defined]
        if not matcher.consume_token(reference_ids[0]):
            return None
        words = np.frombuffer(bytearray(matcher.compute_bitmask()), dtype=np.int32).copy()
        if matcher.is_error():
            return None
        vocab = ll_tokenizer.vocab_size  # type: ignore[attr-defined]
        token_bytes = [ll_tokenizer.decode_bytes([t]) for t in range(vocab)]  # type: ignore[attr-defined]
        holders = [t for t, b in enumerate(token_bytes) if encoded in b]
        bits = words.view(np.uint32)
        for t in holders:
            bits[t // 32] &= ~np.uint32(1 << (t % 32))
        return cls(encoded, words, holders, token_bytes)


class FreeTextState:
    """A request's place relative to the marker: its text's tail and whether it is still in
    the free text."""

    def __init__(self, facts: FreeText) -> None:
        self.facts = facts
        self.tail = b""  # the text's last bytes (enough to see a marker start)
        self.free = True  # no marker written yet
        self.started = False

    def advance(self, token_id: int) -> None:
        if not self.free:
            return
        facts = self.facts
        data = facts.token_bytes[token_id] if token_id < len(facts.token_bytes) else b""
        self.started = self.started or bool(data)
        joined = self.tail + data
        if facts.marker in joined:
            self.free = False  # the calls began (or the request is about to fail)
        self.tail = joined[-(len(facts.marker) + 3) :]

    def clean(self) -> bool:
        """Whether the mask here is the reference one (see the top)."""
        if not (self.free and self.started):
            return False
        marker, tail = self.facts.marker, self.tail
        if any(marker.startswith(tail[-n:]) for n in range(1, min(len(marker), len(tail) + 1))):
            return False
        return _whole_characters(tail)

    def mask_words(self, matcher: object) -> np.ndarray:
        """The mask at a clean point: the reference, with each marker-holding token that the
        matcher takes here allowed."""
        words = self.facts.reference.copy()
        bits = words.view(np.uint32)
        for t in self.facts.marker_tokens:
            if matcher.validate_tokens([t]) == 1:  # type: ignore[attr-defined]
                bits[t // 32] |= np.uint32(1 << (t % 32))
        return words


def _whole_characters(data: bytes) -> bool:
    """Whether ``data`` ends on a whole UTF-8 character (no lead byte waiting for more)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return back == 1
        if byte >= 0xC0:  # a lead byte: how many bytes its character takes
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return need == back
    return True
