"""Incremental detokenization: one generated token id in, the text that is safe to stream out.

Decoding window. Re-decoding the whole output for every token costs O(n) per token, so only a
short window of ids is decoded: ``window[:read]`` is context (ids whose text is already out)
and ``window[read:]`` are ids whose text is not out yet. The text of the new ids is
``decode(window)`` minus ``decode(window[:read])``; decoding them together with context keeps
what a tokenizer does at the start of a sequence (a SentencePiece decoder drops the leading
space of the first token) from leaking into the middle of the output. Once the new ids decode
cleanly, they become the next window's context and the old context is dropped, so a window is
a few tokens long.

Incomplete characters. A byte-level BPE token may carry part of a UTF-8 character (an emoji
split over several tokens); until the rest arrives the decoder renders it as U+FFFD. Text before
a trailing run of U+FFFD is final (UTF-8 resynchronises at every character), so it goes out;
the run waits for more ids. ``flush`` releases it as ``tokenizer.decode`` would render it, U+FFFD
included: bytes still incomplete when the request ends are incomplete for good.

Stop strings. Text that is out (returned to the caller) is never taken back, so the suffix of
the text that is a proper prefix of some stop string is held back: it may turn out to be the
start of a stop. A match that ends in new text therefore always starts inside the held-back
tail, and the search only looks at that tail, from ``len(stop) - 1`` characters before the new
text on: O(held + new) per token, not O(text). The match that starts earliest wins; among
matches at the same start, the shortest (the one a finer-grained stream would have met first).

Prompt context. The last few prompt ids seed the window as context that is never emitted, so
the first output token decodes as it does after the prompt: a SentencePiece ``▁Hello`` keeps
its space, and the output equals ``decode(prompt + output) - decode(prompt)`` over that tail.
For a byte-level BPE tokenizer (the default model's) this is exactly ``decode(output)``.

Assumption: ``decode(ids[:k])`` is a prefix of ``decode(ids)`` once it does not end in U+FFFD.
That holds for byte-level BPE and SentencePiece decoders, not with
``clean_up_tokenization_spaces`` (which rewrites " ." as "." across token boundaries).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Enough prompt ids for the decoder to treat the first output token as mid-text.
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 tokens that carry bytes. A window whose
# text still ends in U+FFFD after this many new ids holds invalid bytes, not an incomplete
# character (a model emitting garbage): release it rather than let the window, and the cost of
# decoding it, grow with every token. (Should the last of those ids start a character that a
# later id completes, that one character differs from decode(output): garbage either way.)
_MAX_PENDING_TOKENS = 8


# decode([id]) per tokenizer and way of decoding (skip_special_tokens, through the Rust
# backend or not), shared by the tokenizer's detokenizers: after each token the window's
# context is usually the one new id, whose text is then a lookup instead of a decode.
_SINGLE_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[tuple[bool, bool], dict[int, str]]] = (
    weakref.WeakKeyDictionary()
)
_SINGLE_TOKEN_LOCK = threading.Lock()


def _single_token_texts(tokenizer: Any, how: tuple[bool, bool]) -> dict[int, str]:
    with _SINGLE_TOKEN_LOCK:
        try:
            per_way = _SINGLE_TOKEN_TEXTS.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that takes no weak reference: a cache of its own
            return {}
        return per_way.setdefault(how, {})


class IncrementalDetokenizer:
    """Turns one request's generated ids into streamable text, stopping at stop strings.

    ``text`` is the output text decoded so far, including text held back as a possible stop
    prefix (not yet returned) but not ids whose bytes are still incomplete. After a stop or a
    ``flush``, the concatenation of everything ``push`` and ``flush`` returned equals ``text``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        skip_text: str = "",
    ) -> None:
        """``skip_text`` is text the output begins with that is not output: token healing drops
        the prompt's last token and makes the first output token start with its text."""
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if any(not s for s in stop):
            # An empty stop string would match before any text: refuse it rather than guess.
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast tokenizer without space clean-up decodes exactly as its Rust backend does:
        # call that directly (transformers' decode wrapper cost ~5 ms a step at batch 64).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend_decode = backend.decode if backend is not None and plain else None
        self._single = _single_token_texts(
            tokenizer, (skip_special_tokens, self._backend_decode is not None)
        )
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))

        context = [int(t) for t in prompt_ids[max(0, len(prompt_ids) - _CONTEXT_TOKENS) :]]
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: the first output bytes would rewrite the
            # context's text. Without context they decode as decode(output) renders them.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)  # window[:read] is context; window[read:] is not out yet
        self._context_text = context_text  # decode(window[:read])
        # Chars of decode(window) past the context text already in the text (or skipped).
        self._moved = len(skip_text)

        self._released: list[str] = []  # text returned to the caller, in pieces
        self._tail = ""  # text not returned yet: held back as a possible stop prefix
        self.matched_stop: str | None = None
        self.stopped = False  # a stop string matched
        self.finished = False  # stopped, or flushed: no more ids are accepted

    @property
    def text(self) -> str:
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return (self._released[0] if self._released else "") + self._tail

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Add one generated token; return the text that is now safe to stream (may be '').

        With ``check_stop`` a stop string that ends in the new text (it may span tokens and
        start in earlier, held-back text) sets ``matched_stop``, cuts ``text`` just before it
        and ends the request: only the text before it is returned. Without it (for example
        while ``min_new_tokens`` is not reached) stops do not match, but possible stop prefixes
        are still held back, so that a stop completed by a later, checked token can be cut.
        """
        if self.finished:
            raise RuntimeError(
                "push() after the request finished "
                + ("(a stop string matched)" if self.stopped else "(flush() was called)")
            )
        self._window.append(int(token_id))
        piece = self._advance(final=False)
        if not self._stops:  # nothing is ever held back (the tail stays empty): all goes out
            if piece:
                self._released.append(piece)
            return piece
        return self._emit(piece, check_stop, final=False)

    def flush(self, check_stop: bool = True) -> str:
        """The request finished for another reason (length, EOS, abort): return the rest.

        Releases the text held back as a possible stop prefix, and ids whose bytes never
        completed as ``tokenizer.decode`` renders them (U+FFFD). Text released here is still
        searched for stops (unless ``check_stop`` is false): a stop can end in text that was
        waiting behind an incomplete character. Returns '' once the request has finished.
        """
        if self.finished:
            return ""
        return self._emit(self._advance(final=True), check_stop, final=True)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_one(self, token: int) -> str:
        """``decode([token])``, remembered per tokenizer (the usual next context: one id)."""
        cache = self._single
        text = cache.get(token)
        if text is None:
            text = cache[token] = self._decode([token])
        return text

    def _advance(self, final: bool) -> str:
        """Decode the window; return the text that became final since the last call."""
        window = self._window
        full = self._decode(window)
        start = len(self._context_text) + self._moved
        pending = len(window) - self._read
        if final or not full.endswith(_REPLACEMENT) or pending > _MAX_PENDING_TOKENS:
            piece = full[start:]
            # The new ids are out: they become the context of the next window.
            del window[: self._read]
            self._read = len(window)
            if len(window) == 1:
                self._context_text = self._decode_one(window[0])
            else:
                self._context_text = self._decode(window)
            self._moved = 0
            return piece
        # Only the trailing U+FFFD run may change when more bytes arrive.
        stable = len(full.rstrip(_REPLACEMENT))
        if stable <= start:
            return ""
        self._moved += stable - start
        return full[start:stable]

    def _emit(self, piece: str, check_stop: bool, final: bool) -> str:
        old_len = len(self._tail)
        tail = self._tail + piece
        match = self._find_stop(tail, old_len) if check_stop and self._stops else None
        if match is not None:
            at, self.matched_stop = match
            tail = tail[:at]
            self.stopped = self.finished = True
            keep = 0
        elif final:
            self.finished = True
            keep = 0
        else:
            keep = self._held_prefix_len(tail)
        out, self._tail = tail[: len(tail) - keep], tail[len(tail) - keep :]
        if out:
            self._released.append(out)
        return out

    def _find_stop(self, tail: str, old_len: int) -> tuple[int, str] | None:
        # A match wholly inside the old tail was ruled out (or ignored) before: each stop is
        # searched only where it would end in the new text.
        best: tuple[int, str] | None = None
        for s in self._stops:
            at = tail.find(s, max(0, old_len - len(s) + 1))
            if at < 0:
                continue
            if best is None or at < best[0] or (at == best[0] and len(s) < len(best[1])):
                best = (at, s)
        return best

    def _held_prefix_len(self, tail: str) -> int:
        """Length of the longest suffix of ``tail`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
