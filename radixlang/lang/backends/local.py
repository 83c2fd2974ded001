"""The in-process backend: programs run on a local :class:`~radixlang.runtime.engine.Engine`.

``Runtime()`` starts an engine on the default model (or ``model``) and is the backend. Every
generation call is one engine request over the program's whole text; the engine's radix cache
makes the shared part free, so branches, turns and batch items never recompute a prefix.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from radixlang.lang.backends.base import Backend, usage_of
from radixlang.lang.chat_template import ChatTemplate, from_tokenizer
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, decide
from radixlang.lang.interpreter import join_program_threads
from radixlang.lang.routing import current_routing_key
from radixlang.lang.run_options import runtime_made, with_runtime_defaults
from radixlang.lang.streamed_runs import SHUTDOWN_ERRORS
from radixlang.model_files import ModelFiles
from radixlang.runtime.engine import Engine, EngineClosedError, shutdown_live_engines
from radixlang.runtime.radix_cache import common_prefix_len
from radixlang.runtime.request import GenerateRequest, GenerationResult

# How long the exit hook waits for programs' threads once their engines are shut down.
EXIT_JOIN_TIMEOUT_S = 5.0


def _stop_programs_at_exit() -> None:
    """At interpreter exit: shut the engines down, then wait for the programs' threads.

    atexit runs hooks last-registered first, so this runs before the engine module's own
    ``shutdown_live_engines`` hook (that module is imported, and registers, first); running it
    here too keeps the order whichever runs first. Engines first: aborting their requests is
    what lets program threads blocked on a result go on, fail (the engine refuses new
    requests) and end. Then those threads are joined, so none is inside native code (a
    tokenizer call) when finalization freezes daemon threads, which would abort the process.
    (Registered after ``streamed_runs``' exit hook, imported above, so it runs before it: the
    streamed runs that the shutdown cuts short end at once, with ``EngineClosedError``, which
    is not a failure to report.)"""
    shutdown_live_engines()
    join_program_threads(EXIT_JOIN_TIMEOUT_S)


atexit.register(_stop_programs_at_exit)
SHUTDOWN_ERRORS.append(EngineClosedError)


class LocalBackend(Backend):
    def __init__(self, engine: Engine, report_programs: bool = False) -> None:
        if engine.tokenizer is None:
            raise ValueError(f"model {engine.files.name} has no tokenizer: programs need text")
        self.engine = engine
        markers = getattr(engine, "reasoning_markers", None)
        self.thinks = markers is not None
        if markers is not None:
            self.thinking_markers = markers.texts
        # A server sharing this engine draws reported programs on its dashboard.
        self.report_programs = report_programs
        self.tokenizer = engine.tokenizer
        self.chat_template = from_tokenizer(engine.tokenizer, engine.files.name)
        if getattr(engine, "tool_format", None) is not None:  # the engine's setting wins
            self.chat_template = dataclasses.replace(
                self.chat_template, tool_format=engine.tool_format
            )
        # The programs whose calls asked the engine to retain their paths (release_program).
        self._retaining: set[str] = set()

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        result = self._submit(prompt, sampling).result()
        return result.text, _meta_info(result)

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each engine step's new text with SGLang's chunk meta_info (see ``Backend``): the
        token counts so far and, with ``return_logprob``, the step's own token logprobs."""
        handle = self._submit(prompt, sampling)
        logprobs = bool(sampling.get("return_logprob"))
        meta: dict[str, Any] = {}
        completion = 0
        try:
            for event in handle:
                if not event.token_ids and not event.text:
                    continue
                completion += len(event.token_ids)
                meta = {**meta, "completion_tokens": completion}
                if event.token_ids:  # a token's event knows the prompt's counts
                    meta["prompt_tokens"] = event.prompt_tokens
                    meta["cached_tokens"] = event.cached_tokens
                piece = dict(meta)
                if logprobs:
                    pairs = zip(event.logprobs, event.token_ids, strict=False)
                    piece["output_token_logprobs"] = [(lp, tok, None) for lp, tok in pairs]
                    piece["output_top_logprobs"] = list(event.top_logprobs)
                    piece["output_token_logprobs_length"] = completion
                yield event.text, piece
            result = handle.result()
        except BaseException:
            handle.abort()
            raise
        yield "", _meta_info(result)

    def _submit(self, prompt: str | list[int], sampling: dict[str, Any]) -> Any:
        sampling = dict(sampling)
        retain = sampling.pop("retain_s", 0.0)
        key = current_routing_key()
        if retain and key is not None:
            self._retaining.add(key)
        if isinstance(prompt, str):
            request = GenerateRequest(text=prompt, sampling=sampling)
        else:
            request = GenerateRequest(input_ids=prompt, sampling=sampling)
        request.routing_key, request.retain_s = key, retain
        return self.engine.submit(request)

    def release_program(self, key: str) -> None:
        if key in self._retaining:
            self._retaining.discard(key)
            with contextlib.suppress(Exception):  # an engine shut down has nothing to keep
                self.engine.release_retained(key)

    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Score every choice in one engine batch over the cached prompt.

        The prompt's last tokens may merge with a choice's first characters (``"Answer:"`` +
        ``" yes"``), so a choice is not scored from the end of the prompt's own tokenization:
        every choice is scored from the first position where any choice's tokenization of
        ``prompt + choice`` departs from the prompt's, the same position for all, so no choice
        gains or loses by how the boundary tokenizes."""
        encode = self.tokenizer.encode
        prompt_ids = encode(prompt)
        full = [encode(prompt + c) for c in choices]
        start = min(common_prefix_len(prompt_ids, ids) for ids in full)
        start = max(1, min(start, min(len(ids) for ids in full) - 1))
        scoring = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": start}
        handles = [self._submit(ids, scoring) for ids in full]
        alone = []
        if method.requires_unconditional_logprobs:
            alone_scoring = {**scoring, "logprob_start_len": 0}
            alone = [self._submit(encode(c), alone_scoring) for c in choices]
        try:
            results = [h.result() for h in handles + alone]
        except BaseException:
            for h in handles + alone:
                h.abort()
            raise
        scored = [self._token_logprobs(r) for r in results[: len(handles)]]
        unconditional = [self._token_logprobs(r) for r in results[len(handles) :]] or None
        decision = decide(choices, scored, method, temperature, start, unconditional)
        decision.meta_info.update(usage_of([r.meta_info for r in results]))
        return decision

    def _token_logprobs(self, result: GenerationResult) -> list[TokenLogprob]:
        return [
            (lp if lp is not None else 0.0, tok, self.tokenizer.decode([tok]))
            for tok, lp in result.prompt_logprobs
        ]

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:
        handle = self._submit(prompt, {"max_new_tokens": 0})
        if wait:
            handle.result()

    def flush_cache(self, wait: float | None = 0.0) -> bool:
        """Drop the engine's cached prefixes (``Engine.flush_cache``): True, or
        ``CacheBusyError`` when requests are still in flight after ``wait`` seconds."""
        return self.engine.flush_cache(wait)

    def report_program(self, name: str, graph: dict[str, Any], status: str) -> None:
        self.engine.programs.add(name, graph, status)

    def reset_stats(self) -> None:
        """Zero the engine's cumulative counters (``Engine.reset_stats``)."""
        self.engine.reset_stats()

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def cache_summary(self) -> str:
        """One line: prompt tokens reused vs computed, the hit rate, tokens generated."""
        st = self.engine.stats()
        return (
            f"prompt tokens: {st['prompt_tokens_reused']} reused, {st['prompt_tokens_computed']} "
            f"computed of {st['prompt_tokens']} (cache hit rate {st['cache_hit_rate']:.1%}); "
            f"{st['generated_tokens']} tokens generated"
        )

    def shutdown(self) -> None:
        self.engine.shutdown()


def _meta_info(result: GenerationResult) -> dict[str, Any]:
    meta = dict(result.meta_info)
    meta["output_ids"] = result.output_ids
    if result.output_logprobs:
        pairs = zip(result.output_logprobs, result.output_ids, strict=False)
        meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in pairs]
        meta["output_top_logprobs"] = result.output_top_logprobs
    if result.prompt_logprobs:
        meta["input_token_logprobs"] = [(lp, tok, None) for tok, lp in result.prompt_logprobs]
        meta["input_top_logprobs"] = result.prompt_top_logprobs
    return meta


class Runtime(LocalBackend):
    """A local runtime: an engine on ``model`` (the default model when omitted).

    ``model_path=`` is an alias for ``model`` (SGLang's name: ``sgl.Runtime(model_path=...)``
    programs run unchanged); giving both is a ``TypeError``. Keyword arguments go to
    :class:`~radixlang.runtime.engine.Engine`, by its names (``dtype``, default ``"auto"``;
    ``device``, ``kv_memory``, ``threads``, ``max_batch_tokens``, ``schedule_policy``, ...).
    ``report_programs=True``: each program run here leaves its call graph in the engine's
    ``programs`` log, which a server on the same engine draws on its dashboard."""

    def __init__(
        self,
        model: str | Path | ModelFiles | None = None,
        *,
        model_path: str | Path | ModelFiles | None = None,
        report_programs: bool = False,
        **engine_args: Any,
    ) -> None:
        if model is not None and model_path is not None:
            raise TypeError(
                "Runtime() got both model and model_path: they name the same argument "
                "(model_path is SGLang's name for it), give one"
            )
        model = model if model is not None else model_path
        engine_args = with_runtime_defaults(engine_args)  # `radixlang run`'s settings, if any
        if model is not None:
            engine_args["model"] = model
        super().__init__(Engine(**engine_args), report_programs=report_programs)
        runtime_made(self)
