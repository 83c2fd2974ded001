"""Grammar-constrained decoding on llguidance: regex, JSON schema, Lark and EBNF grammars.

One compiled engine (llguidance, Rust) serves every kind of constraint. A grammar is compiled
once per (kind, source, tokenizer) into a template matcher kept in a small LRU; each request gets
a copy of it (:class:`GrammarConstraint`), which the engine asks for the next token mask,
advances with each sampled token, and asks for *forced* tokens (jump-forward decoding). Masks
for a whole batch are filled into one bitmask by llguidance's thread pool
(:func:`batch_allowed_masks`) and unpacked to bool rows with one tensor operation.

Sources are checked before compilation, so an error names what is wrong: Python's ``re`` checks a
regex, ``lark`` checks a Lark grammar (with line and column), ``jsonschema`` checks a schema
against its meta-schema (those checks live in the torch-free ``sources``, which the language
layer shares), and llguidance reports what it does not support.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from radixlang.constrain.errors import ConstraintError
from radixlang.constrain.free_text import FreeText, FreeTextState
from radixlang.constrain.sources import (
    closed_objects,  # noqa: F401 (re-exported: the tests and benchmarks import it from here)
    is_pydantic_model,
    json_schema_text,
    lark_error,
    regex_error,
)
from radixlang.constrain.tool_calls import free_text_marker

KINDS = ("regex", "json_schema", "grammar", "ebnf")
_CACHE_SIZE = 128
# JSON as json.dumps writes it: one space after ':' and ',', no other whitespace. A fixed layout
# makes keys and punctuation forced text (jump-forward) and keeps a sampling model from
# wandering into unbounded whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# An object with any keys: OpenAI's response_format {"type": "json_object"}.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_source(kind: str, source: Any) -> str:
    """The llguidance grammar for a constraint of ``kind`` (one of :data:`KINDS`).

    :class:`ConstraintError` for a source that is malformed; llguidance's own validation
    (unsupported features) happens in :func:`compile_grammar`.
    """
    if kind == "json_schema":
        text = json_schema_text(source)
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
    if not isinstance(source, str):
        raise ConstraintError(f"{kind} must be a str, got {type(source).__name__}")
    if kind == "regex":
        error = regex_error(source)
        if error is not None:
            raise ConstraintError(f"invalid regex {source!r}: {error}")
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "grammar":
        complaint = lark_error(source, verbatim=True)
        grammar = llguidance.LLMatcher.grammar_from_lark(source)
        if complaint is not None and _validation_error(grammar) is not None:
            # Both reject it: lark's message says where. (A grammar lark rejects but llguidance
            # takes uses llguidance's extensions, such as %json or lazy rules.)
            raise ConstraintError(f"invalid Lark grammar: lark: {complaint}")
        return grammar
    if kind == "ebnf":
        try:
            return llguidance.grammar_from("ebnf", source)
        except Exception as e:
            raise ConstraintError(f"invalid EBNF grammar: {e}") from None
    raise ConstraintError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")


def _validation_error(grammar: str, tokenizer: Any = None) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return messages[0] if is_error else None


# ---- tokenizers ----------------------------------------------------------------------------


class _ByteTokens:
    """A slow tokenizer seen as llguidance's ``TokenizerWrapper`` wants it: bytes per id."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.special_token_ids = sorted(t for t in special if 0 <= t < vocab_size)
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            try:
                text = tokenizer.decode([i]) if i not in special else ""
            except Exception:
                text = ""
            self.tokens.append(text.encode("utf-8") if isinstance(text, str) else b"")

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, llguidance.LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """llguidance's view of ``tokenizer`` (about 1 s to build; cached per tokenizer)."""
    eos = tuple(sorted(int(t) for t in eos_token_ids))
    key = (id(tokenizer), vocab_size, eos)
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None and hasattr(backend, "to_str"):
        # A fast (Rust) tokenizer: llguidance reads its JSON, byte-level merges and all.
        from copy import copy

        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos))
    else:
        wrapper = llguidance.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size, eos))
        ll = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos))
    with _tokenizers_lock:
        _tokenizers[key] = (tokenizer, ll)  # holds the tokenizer, so its id is never reused
    return ll


# ---- compiled grammars ---------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer; :meth:`new_constraint` starts a request on it."""

    kind: str
    source: str
    template: Any  # llguidance.LLMatcher in its initial state, copied per request
    tokenizer: Any  # llguidance.LLTokenizer
    eos_token_ids: frozenset[int]
    free_text: FreeText | None = None  # free text before a marker: masks skipped there

    def new_constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self, self.template.deep_copy())


_grammars: collections.OrderedDict[tuple[str, str, int], CompiledGrammar] = (
    collections.OrderedDict()
)
_grammars_lock = threading.Lock()


def compile_grammar(
    kind: str,
    source: Any,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: Iterable[int],
    timeout: float | None = None,
) -> CompiledGrammar:
    """The compiled grammar for ``source`` of ``kind`` on ``tokenizer`` (from a small LRU).

    Compiling includes the first token mask, so a grammar that llguidance's resource limits
    reject (a lexer that explodes) is refused here, not in the middle of a request. With
    ``timeout`` (seconds), a compilation that takes longer is refused with a
    :class:`ConstraintError`, and so is that source again at once: the work goes on in a
    background thread (llguidance's fuel limits end it) and its result is dropped.
    """
    eos = frozenset(int(t) for t in eos_token_ids)
    ll = ll_tokenizer(tokenizer, vocab_size, eos)
    if kind == "json_schema" and is_pydantic_model(source):
        source = source.model_json_schema()  # built once, for the key and the grammar
    # Keyed by the source as given (a model class by its schema), so a hit skips the checks
    # and the conversion too.
    key = (kind, _source_key(source), id(ll))
    with _grammars_lock:
        hit = _grammars.get(key)
        if hit is not None:
            _grammars.move_to_end(key)
            return hit
        slow = _too_slow.get(key)
    if slow is not None:
        raise ConstraintError(f"{kind}: took longer than {slow:g} s to compile; simplify it")
    if timeout is None:
        compiled = _compile(kind, source, ll, eos)
    else:
        future = _compile_threads().submit(_compile, kind, source, ll, eos)
        try:
            compiled = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            with _grammars_lock:
                _too_slow[key] = timeout
                while len(_too_slow) > _CACHE_SIZE:
                    _too_slow.popitem(last=False)
            raise ConstraintError(
                f"{kind}: took longer than {timeout:g} s to compile; simplify it"
            ) from None
    with _grammars_lock:
        _grammars[key] = compiled
        while len(_grammars) > _CACHE_SIZE:
            _grammars.popitem(last=False)
    return compiled


def _compile(kind: str, source: Any, ll: Any, eos: frozenset[int]) -> CompiledGrammar:
    grammar = grammar_source(kind, source)
    error = _validation_error(grammar, ll)
    if error is not None:
        raise ConstraintError(f"{kind}: {error}")
    template = llguidance.LLMatcher(ll, grammar, log_level=0)
    if template.is_error():
        raise ConstraintError(f"{kind}: {template.get_error()}")
    probe = template.deep_copy()  # the first mask: where an exploding lexer shows itself
    probe.compute_bitmask()
    if probe.is_error():
        raise ConstraintError(f"{kind}: {_first_line(probe.get_error())}")
    marker = free_text_marker(source) if kind == "grammar" else None
    free = FreeText.build(marker, template, ll) if marker else None
    return CompiledGrammar(kind, grammar, template, ll, eos, free)


def _first_line(message: str) -> str:
    """llguidance's error without the parser state it appends (lines that follow the first)."""
    return message.strip().splitlines()[0] if message.strip() else message


_too_slow: collections.OrderedDict[tuple[str, str, int], float] = collections.OrderedDict()
_compile_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _compile_threads() -> concurrent.futures.ThreadPoolExecutor:
    """Two threads for timed compilations: a flood of slow grammars waits in their queue (and
    times out there) instead of taking every core."""
    global _compile_pool
    with _grammars_lock:
        if _compile_pool is None:
            _compile_pool = concurrent.futures.ThreadPoolExecutor(2, "grammar-compile")
        return _compile_pool


def _source_key(source: Any) -> str:
    if isinstance(source, str):
        return "s" + source
    try:
        return "j" + json.dumps(source)  # key order kept: it is the fields' generation order
    except (TypeError, ValueError):
        return "r" + repr(source)


def clear_grammar_cache() -> None:
    """Forget every compiled grammar and tokenizer view."""
    with _grammars_lock:
        _grammars.clear()
        _too_slow.clear()
    with _tokenizers_lock:
        _tokenizers.clear()


# ---- one request's constraint --------------------------------------------------------------


class GrammarConstraint:
    """One request's position in a :class:`CompiledGrammar` (a ``TokenConstraint``).

    Besides the protocol (``allowed_mask``, ``advance``, ``is_finished``, ``may_end``,
    ``ends_on``) it offers ``forced_tokens()`` for jump-forward decoding and a batched
    :meth:`batch_allowed_masks` that the engine calls once per step for all such rows.
    """

    def __init__(self, grammar: CompiledGrammar, matcher: Any) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self.free = FreeTextState(grammar.free_text) if grammar.free_text else None

    def _free_words(self) -> np.ndarray | None:
        """The mask's words where it is free text's reference one (see free_text.py)."""
        if self.free is None or not self.free.clean():
            return None
        return self.free.mask_words(self.matcher)

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())

    def allowed_mask(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens that may come next (EOS where the text is done)."""
        self._raise_if_error()
        vocab = self.grammar.tokenizer.vocab_size
        words = self._free_words()
        if words is not None:
            facts = self.grammar.free_text
            if facts.unpacked is None:  # the reference as bools, unpacked once
                facts.unpacked = unpack_bits(torch.from_numpy(facts.reference.view(np.uint8))
                                             .unsqueeze(0), vocab)[0]  # fmt: skip
            if np.array_equal(words, facts.reference):  # no marker token allowed (the usual)
                return facts.unpacked.clone()
            bits = torch.from_numpy(words.view(np.uint8))
        else:
            bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        return unpack_bits(bits.unsqueeze(0), vocab)[0]

    @staticmethod
    def batch_allowed_masks(constraints: Sequence[GrammarConstraint], width: int) -> torch.Tensor:
        """Bool ``[len(constraints), width]``: every row's mask, filled in one parallel call."""
        for c in constraints:
            c._raise_if_error()
        vocab = max(c.grammar.tokenizer.vocab_size for c in constraints)
        if vocab > width:
            raise ConstraintError(f"the tokenizer's {vocab} tokens exceed the logits' {width}")
        words = (vocab + 31) // 32
        # numpy, not torch: this runs beside the forward on the mask worker, where a torch op
        # big enough to go parallel starts a second OpenMP team, and on a 2-core CPU every
        # later forward pass then ran about 2x slower (after a batch of 32 JSON-schema rows).
        bitmask = torch.from_numpy(np.zeros((len(constraints), words), dtype=np.int32))
        computed = []
        for i, c in enumerate(constraints):
            free = c._free_words()
            if free is None:
                computed.append((c.matcher, i))
            else:
                bitmask.numpy()[i, : len(free)] = free
        if computed:
            _executor().unsafe_compute_mask_ptr(
                computed, bitmask.data_ptr(), words * 4, len(constraints)
            )
        for c in constraints:
            c._raise_if_error()
        return unpack_bits(bitmask.view(torch.uint8), width)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (jump-forward); the caller then ``advance``-s
        through them. llguidance leaves out a last token that more text could merge into, so
        the forced tokens are the ones token-by-token decoding would produce."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return []
        return list(self.matcher.compute_ff_tokens())

    def advance(self, token_id: int) -> None:
        """Take ``token_id``; :class:`ConstraintError` if the grammar does not allow it."""
        if not self.matcher.consume_token(int(token_id)):
            error = self.matcher.get_error() or f"token {token_id} is not allowed here"
            raise ConstraintError(error)
        if self.free is not None:
            self.free.advance(int(token_id))

    def is_finished(self) -> bool:
        """The text is complete and nothing but EOS may follow (or an EOS was taken)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def may_end(self) -> bool:
        """The text is complete but could go on: the model may end it (see ``ends_on``)."""
        return self.matcher.is_accepting() and not self.matcher.is_stopped()

    def ends_on(self, token_id: int) -> bool:
        """The text is complete and ``token_id`` cannot extend it: it ends before the token."""
        if token_id in self.grammar.eos_token_ids:
            return False
        return self.matcher.is_accepting() and self.matcher.validate_tokens([int(token_id)]) == 0


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool ``[rows, width]`` from little-endian packed bits ``uint8 [rows, bytes]``.

    numpy's unpackbits is one C loop (0.5 ms for 32 rows of 49,152 tokens); the same in torch
    ops took 5-15 ms here, waiting on its thread team.
    """
    bits = np.unpackbits(packed.numpy(), axis=1, bitorder="little")
    if bits.shape[1] < width:  # numpy here too (see batch_allowed_masks)
        bits = np.pad(bits, ((0, 0), (0, width - bits.shape[1])))
    return torch.from_numpy(bits).view(torch.bool)[:, :width]


_executor_instance: Any = None
_executor_lock = threading.Lock()


def _executor() -> Any:
    global _executor_instance
    with _executor_lock:
        if _executor_instance is None:
            # A few threads: masks are filled between forward passes, not beside them.
            _executor_instance = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
        return _executor_instance
