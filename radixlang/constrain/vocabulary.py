"""A tokenizer's vocabulary as constrained decoding sees it: each token's text, in a trie.

Every token id is decoded once, on its own. A token is *usable* when its text is what it adds to
any sequence it ends: not a special token (``<|im_end|>`` is markup, not text), not empty, and
valid UTF-8 on its own (a byte-level BPE token carrying part of a character decodes to U+FFFD;
such tokens are left out, so constrained text is built from whole characters only). The usable
tokens go into a character trie, so a walk over it visits each shared prefix once (``" the"``,
``" then"``, ``" there"`` share three nodes), and a branch the constraint rejects is cut with
everything below it.

Built once per (tokenizer, vocab size) and kept in a small LRU: the default model's 49152 tokens
take about 0.3 s to decode and index.
"""

from __future__ import annotations

import collections
import gc
import threading
from typing import Any

_REPLACEMENT = "\ufffd"
_SPIECE_SPACE = "\u2581"  # SentencePiece's word-start marker
_CACHE_SIZE = 4


class TrieNode:
    """One character position: children by next character, and the tokens that end here."""

    __slots__ = ("children", "tokens")

    def __init__(self) -> None:
        self.children: dict[str, TrieNode] = {}
        self.tokens: list[int] = []


class TokenVocabulary:
    """The usable tokens of ``tokenizer`` among ids ``[0, vocab_size)``, by text and in a trie."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.tokenizer = tokenizer  # held so that id(tokenizer) stays this tokenizer's
        self.vocab_size = vocab_size
        try:
            n = min(len(tokenizer), vocab_size)
        except TypeError:  # no __len__: assume it decodes every id the model can produce
            n = vocab_size
        special = _special_ids(tokenizer)
        # text[i]: what token i adds to the text; None for an unusable token.
        self.text: list[str | None] = [None] * vocab_size
        pieces = _pieces(tokenizer, n)
        for i, s in enumerate(_decode_each(tokenizer, n)):
            if i in special or not s or _REPLACEMENT in s:
                continue
            # A SentencePiece decoder drops a word-start space at the start of a sequence; the
            # token adds that space mid-text, which is where constrained tokens go.
            if pieces is not None and pieces[i].startswith(_SPIECE_SPACE) and s[0] != " ":
                s = " " + s
            self.text[i] = s
        self.root = TrieNode()
        self.charset: set[str] = set()
        # ~100k small objects: the cyclic GC would scan them over and over while they are made.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._build_trie()
        finally:
            if gc_was_on:
                gc.enable()

    def _build_trie(self) -> None:
        for i, s in enumerate(self.text):
            if s is None:
                continue
            node = self.root
            for c in s:
                child = node.children.get(c)
                if child is None:
                    child = node.children[c] = TrieNode()
                node = child
            node.tokens.append(i)
            self.charset.update(s)

    @property
    def num_usable(self) -> int:
        return sum(s is not None for s in self.text)

    def extending(self, text: str) -> list[int] | None:
        """The usable tokens whose text starts with ``text``, if some of them are longer than
        ``text`` (so a sequence ending in ``text`` may be a cut-off longer token); else None."""
        node = self.root
        for ch in text:
            nxt = node.children.get(ch)
            if nxt is None:
                return None
            node = nxt
        if not node.children:
            return None
        found: list[int] = []
        stack = [node]
        while stack:
            n = stack.pop()
            found.extend(n.tokens)
            stack.extend(n.children.values())
        return found


def _special_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, tok in added.items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _pieces(tokenizer: Any, n: int) -> list[str] | None:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    try:
        pieces = convert(list(range(n)))
    except Exception:  # a tokenizer without pieces for every id: skip the space fix
        return None
    return [p if isinstance(p, str) else "" for p in pieces]


def _decode_each(tokenizer: Any, n: int) -> list[str]:
    """Each of ids ``[0, n)`` decoded on its own."""
    # A fast tokenizer without space clean-up decodes exactly as its Rust backend does, and the
    # backend decodes a batch in one call (~30 ms for 49k ids instead of ~250 ms one by one).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return [_decode_one(tokenizer, i) for i in range(n)]


def _decode_one(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    except TypeError:  # a decode() without those options
        return tokenizer.decode([token_id])


_cache: collections.OrderedDict[tuple[int, int], TokenVocabulary] = collections.OrderedDict()
_cache_lock = threading.Lock()


def token_vocabulary(tokenizer: Any, vocab_size: int) -> TokenVocabulary:
    """The (cached) vocabulary of ``tokenizer`` over ids ``[0, vocab_size)``."""
    key = (id(tokenizer), vocab_size)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit.tokenizer is tokenizer:
            _cache.move_to_end(key)
            return hit
    vocab = TokenVocabulary(tokenizer, vocab_size)  # outside the lock: it takes a while
    with _cache_lock:
        _cache[key] = vocab
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return vocab


def clear_vocabulary_cache() -> None:
    """Forget every cached vocabulary."""
    with _cache_lock:
        _cache.clear()
