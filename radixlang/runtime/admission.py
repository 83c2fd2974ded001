"""Admission: what the engine checks of a request before it is queued, and the ``Req`` it makes
of it. It runs on the submitting thread (``Engine.submit``), so a bad request is refused there
with a :class:`RequestError` that names what is wrong, before it can reach the engine thread,
and a grammar compiles beside the engine's steps, never on its thread.

The functions read the engine's settings (``tokenizer``, ``files``, ``runner.vocab_size`` and
``sliding_window``, ``max_context``, ``pool``, ``eos_token_ids``, ``grammar_compile_timeout``,
``allow_auto_truncate``) as they are at each submission; the engine is passed in, not imported.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import torch

from radixlang.constrain import ConstraintError, compile_grammar, token_vocabulary
from radixlang.constrain.reasoning import opened_in_prompt
from radixlang.constrain.thinking_first import ThinkingFirst
from radixlang.runtime.beam_search import BeamGroup, BeamSearchError
from radixlang.runtime.block_pool import blocks_for
from radixlang.runtime.constraint import TokenConstraint
from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.request import (
    MAX_CACHE_SALT_CHARS,
    GenerateRequest,
    Req,
    RequestError,
)
from radixlang.runtime.sampling import SamplingParams, SamplingParamsError


def retain_seconds(value: Any) -> float:
    """A request's ``retain_s``: seconds >= 0 (a RequestError otherwise)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not value >= 0 or value == float("inf"):
        raise RequestError(f"retain_s must be a number of seconds >= 0, got {value!r}")
    return float(value)


def admit(
    engine: Any, request: GenerateRequest, salt: str
) -> tuple[Req, IncrementalDetokenizer | None]:
    """The request's ``Req`` (its prompt's ids, checked parameters, stop ids, constraint, token
    healing, beams, cache salt) and its detokenizer (None without a tokenizer), or a
    :class:`RequestError`."""
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestError(
            f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters"
        )
    params = sampling_params(request.sampling)
    prompt_ids = prompt_token_ids(engine, request)
    # An unset max_new_tokens (the default) is cut to fit; a given one must fit, unless
    # allow_auto_truncate cuts it too.
    given = request.sampling
    unset = given is None or (isinstance(given, Mapping) and "max_new_tokens" not in given)
    check_fits(engine, prompt_ids, params, cut_to_fit=unset or engine.allow_auto_truncate)
    constraint = request_constraint(engine, request, params, prompt_ids)
    healed, first_token_mask = "", None
    if params.token_healing and constraint is None and request.text is not None:
        healed, first_token_mask = token_healing(engine, prompt_ids)
        if first_token_mask is not None:
            prompt_ids = prompt_ids[:-1]
    rid = request.request_id or uuid.uuid4().hex
    req = Req(
        rid=rid,
        prompt_ids=prompt_ids,
        params=params,
        stop_ids=frozenset(params.stop_token_ids)
        | (frozenset() if params.ignore_eos else engine.eos_token_ids),
        # A healed token re-decides the prompt's last one: it does not count against the
        # limit, so a model that picks the same token gives the same text as without.
        output_limit=min(
            params.max_new_tokens + (first_token_mask is not None),
            engine.max_context - len(prompt_ids),
        ),
        generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
        constraint=constraint,
        first_token_mask=first_token_mask,
        cache_salt=salt,
        program=request.routing_key or rid,
        retain_s=min(retain_seconds(request.retain_s), engine.config.retain_max_s),
    )
    if params.beam_width > 1:
        if constraint is not None:
            raise RequestError("beam search does not support a constraint")
        try:
            req.beam = BeamGroup(req, engine.tokenizer, engine.runner.vocab_size)
        except BeamSearchError as e:
            raise RequestError(str(e)) from None
    detokenizer = None
    if engine.tokenizer is not None:
        try:
            # Thinking markers that are special tokens (Magistral's) stay in the text, which
            # splits the thinking from the answer by them.
            markers = getattr(engine, "reasoning_markers", None)
            skip_special = params.skip_special_tokens and not (markers and markers.special)
            detokenizer = IncrementalDetokenizer(
                engine.tokenizer,
                prompt_ids,
                params.stop,
                skip_special,
                skip_text=healed,
            )
        except (TypeError, ValueError) as e:
            raise RequestError(f"stop: {e}") from None
    return req, detokenizer


def sampling_params(sampling: SamplingParams | dict | None) -> SamplingParams:
    """The request's sampling parameters, checked."""
    try:
        if sampling is None:
            return SamplingParams()
        if isinstance(sampling, dict):
            return SamplingParams.from_dict(sampling)
        if isinstance(sampling, SamplingParams):
            sampling.validate()
            return sampling
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None
    raise RequestError(f"sampling must be SamplingParams or a dict, not {type(sampling)}")


def request_constraint(
    engine: Any, request: GenerateRequest, params: SamplingParams, prompt_ids: list[int]
) -> TokenConstraint | None:
    """The request's constraint: its own, or one compiled from the sampling parameters'
    regex, json_schema, ebnf or grammar (compiled on the caller's thread, not the engine's).
    On a reasoning model it holds the answer only, after the thinking (``ThinkingFirst``),
    which ``thinking_budget`` bounds."""
    constraint = _answer_constraint(engine, request, params)
    markers = getattr(engine, "reasoning_markers", None)
    budget = params.thinking_budget if params.thinking_budget >= 0 else None
    if markers is None:
        if budget is not None:
            raise RequestError(f"thinking_budget: model {engine.files.name} does not think "
                               "(no <think> and </think> tokens in its chat template)")  # fmt: skip
        return constraint
    if constraint is None and budget is None:
        return None
    opened = opened_in_prompt(prompt_ids, markers)
    vocab = engine.runner.vocab_size
    return ThinkingFirst(constraint, markers, vocab, engine.eos_token_ids, budget, opened)


def _answer_constraint(
    engine: Any, request: GenerateRequest, params: SamplingParams
) -> TokenConstraint | None:
    if request.constraint is not None:
        if params.structured_output is not None:
            kind = params.structured_output[0]
            raise RequestError(f"give either sampling {kind} or a constraint, not both")
        if not isinstance(request.constraint, TokenConstraint):
            raise RequestError(
                "constraint must have allowed_mask(), advance(token_id) and is_finished(), "
                f"got {type(request.constraint).__name__}"
            )
        return request.constraint
    structured = params.structured_output
    if structured is None:
        return None
    kind, source = structured
    if engine.tokenizer is None:
        raise RequestError(f"{kind} needs a tokenizer; model {engine.files.name} has none")
    try:
        grammar = compile_grammar(
            kind,
            source,
            engine.tokenizer,
            engine.runner.vocab_size,
            engine.eos_token_ids,
            engine.grammar_compile_timeout,
        )
    except ConstraintError as e:
        raise RequestError(f"{kind}: {e}") from None
    return grammar.new_constraint()


def token_healing(engine: Any, prompt_ids: list[int]) -> tuple[str, torch.Tensor | None]:
    """``(text, mask)`` when the prompt's last token may be a cut-off longer token: its
    text, and the tokens that start with it (the first output token must be one). A
    prompt that ends on a clean boundary gets ``("", None)`` and is left as it is."""
    if len(prompt_ids) < 2:
        return "", None
    vocab = token_vocabulary(engine.tokenizer, engine.runner.vocab_size)
    last = prompt_ids[-1]
    text = vocab.text[last] if 0 <= last < len(vocab.text) else None
    ids = vocab.extending(text) if text else None
    if not ids:
        return "", None
    mask = torch.zeros(engine.runner.vocab_size, dtype=torch.bool)
    mask[ids] = True
    return text, mask


def prompt_token_ids(engine: Any, request: GenerateRequest) -> list[int]:
    """The prompt's token ids: its text tokenized, or its input_ids checked."""
    if (request.text is None) == (request.input_ids is None):
        raise RequestError("give exactly one of text and input_ids")
    if request.text is not None:
        if not isinstance(request.text, str):
            raise RequestError(f"text must be a string, not {type(request.text).__name__}")
        if engine.tokenizer is None:
            raise RequestError(f"model {engine.files.name} has no tokenizer: send input_ids")
        ids = list(engine.tokenizer.encode(request.text))
    else:
        ids = list(request.input_ids)  # type: ignore[arg-type]
        vocab = engine.runner.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of ints")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids hold ids outside [0, {vocab}): {bad[:5]}")
    if not ids:
        raise RequestError("the prompt is empty")
    return ids


def check_fits(
    engine: Any, prompt_ids: list[int], params: SamplingParams, cut_to_fit: bool = True
) -> None:
    """Refuse what cannot run: a prompt past the context or the pool, a max_new_tokens past
    the context (unless ``cut_to_fit``), token ids outside the vocabulary, stops without a
    tokenizer."""
    n = len(prompt_ids)
    if (n >= engine.max_context and params.max_new_tokens > 0) or n > engine.max_context:
        raise RequestError(
            f"the prompt has {n} tokens; the model's context window is {engine.max_context} "
            f"tokens, which must also hold at least one generated token"
        )
    if not cut_to_fit and n + params.max_new_tokens > engine.max_context:
        raise RequestError(
            f"max_new_tokens is {params.max_new_tokens}, but after the prompt's {n} tokens "
            f"at most {engine.max_context - n} fit in the context window of "
            f"{engine.max_context} tokens: ask for fewer (or let the engine cut it to fit: "
            f"allow_auto_truncate)"
        )
    need = blocks_for(n + (params.max_new_tokens > 0), engine.pool.block_size)
    window = engine.runner.sliding_window
    if window is not None:
        # Blocks before the window are released and chunks are at most a window long, so
        # a request never holds more than two windows' worth (plus a block of alignment).
        need = min(need, blocks_for(2 * window, engine.pool.block_size) + 1)
    if need > engine.pool.num_blocks:
        raise RequestError(
            f"the prompt needs {need} KV blocks but the pool has {engine.pool.num_blocks}: "
            f"give the engine more kv_memory"
        )
    vocab = engine.runner.vocab_size
    if params.logit_bias and not all(t < vocab for t in params.logit_bias):
        bad = sorted(t for t in params.logit_bias if t >= vocab)[:5]
        raise RequestError(f"logit_bias holds token ids outside [0, {vocab}): {bad}")
    if params.stop and engine.tokenizer is None:
        raise RequestError("stop strings need a tokenizer; this model has none")


def eos_token_ids(files: Any, tokenizer: Any | None) -> frozenset[int]:
    """The model's end-of-sequence ids: its config's and its tokenizer's."""
    ids = set(files.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
