"""The engine: requests in, tokens out, one background thread running ``step()``.

Each step the scheduler picks the chunks to compute (decodes, prefill chunks, new requests), the
model runner computes them in one packed forward pass, the sampler picks the next tokens, and
the detokenizer turns them into text, stopping at stop strings. Requests arrive from any thread
through ``submit``; their handles stream events and hold the final result.

Nothing here knows about programs: the frontend talks to the engine through ``submit``,
``generate``, ``abort``, ``flush_cache``, ``stats`` and ``reset_stats``.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import functools
import inspect
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from radixlang.config import (  # parse_memory: re-exported, its old home
    ENGINE_SETTINGS,
    EngineConfig,
    did_you_mean,
    parse_memory,
)
from radixlang.constrain.reasoning import reasoning_markers
from radixlang.constrain.tool_formats import format_for
from radixlang.model_files import ModelFiles
from radixlang.runtime import admission, cache_store, token_output
from radixlang.runtime.beam_search import (
    split_beam_rows,
)
from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.cpu_threads import ThreadGovernor, adapt_by_default
from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.disk_tier import SpillingTier
from radixlang.runtime.dtype_choice import choose_dtype
from radixlang.runtime.engine_view import block_owners, request_rows, tree_view
from radixlang.runtime.grammar_masks import MaskFiller
from radixlang.runtime.handle import EventCallback, RequestHandle, ResultCallback
from radixlang.runtime.host_tier import HostTier
from radixlang.runtime.kv_cache import KVCache
from radixlang.runtime.kv_events import KvEvent
from radixlang.runtime.memory_report import MemoryReport, collect_memory_report
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.overlap import (
    InflightStep,
)
from radixlang.runtime.program_log import ProgramLog
from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.request import (  # RequestError: re-exported, its old home
    FinishReason,
    GenerateRequest,
    GenerationResult,
    Req,
    RequestError,
    as_request,
)
from radixlang.runtime.request_outputs import RequestOutputs
from radixlang.runtime.sampling import (
    SamplingParams,
    sample,
)
from radixlang.runtime.sampling_rows import SamplingRows
from radixlang.runtime.scheduler import Chunk, Scheduler
from radixlang.runtime.speculative.drafter import Drafter
from radixlang.runtime.speculative.step_cost import CPU_PRIOR, GPU_PRIOR, StepCost
from radixlang.runtime.speculative.verify import DraftVerifier
from radixlang.runtime.step_loop import OneAtATime, Overlapped
from radixlang.runtime.tier_prefetch import TierCopier

log = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_KEYS = {s.key: s for s in ENGINE_SETTINGS}

DEFAULT_MAX_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}
THROUGHPUT_WINDOW_S = 10.0
# With overlap the device thread takes the GIL back after each op it runs without it; at
# CPython's default switch interval (5 ms) it waited up to that long whenever the engine
# thread was running Python, which undid the overlap (benchmarks/bench_host_overhead.py).
OVERLAP_SWITCH_INTERVAL_S = 0.00005

Prompt = str | Sequence[int]


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


class CacheBusyError(RuntimeError):
    """``flush_cache`` found requests still in flight when its wait ran out: nothing flushed."""


# Engines whose thread runs, shut down at interpreter exit by ``shutdown_live_engines``.
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def shutdown_live_engines() -> None:
    """Shut down every engine whose thread still runs: abort its requests, join its thread.

    Registered with ``atexit``, which CPython runs after ``threading._shutdown`` has joined
    the non-daemon threads (and, through ``threading._register_atexit``, the
    ``ThreadPoolExecutor`` workers, e.g. ``run_batch``'s) and before finalization freezes the
    daemon threads. After the join of non-daemon threads, so that work a non-daemon thread
    still waits for finishes on a live engine rather than being aborted under it; before the
    freeze, because a daemon engine thread frozen inside a forward pass (torch/OpenMP code,
    GIL released) is killed by ``pthread_exit`` when it next takes the GIL, and the forced
    unwind through C++ frames aborts the process ("terminate called without an active
    exception", status 134). Safe to call more than once, and from other exit hooks."""
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:  # one engine's failure must not keep the others running
            log.exception("could not shut down an engine at exit")


atexit.register(shutdown_live_engines)


class Engine:
    """Continuous batching over a radix prefix cache on one model.

    Its settings are keyword arguments, or ``config=EngineConfig(...)``: one per row of
    ``radixlang.config.ENGINE_SETTINGS``, the table the ``[engine]`` config file and the
    command line's flags are made from too (names, defaults, checks, help; ``radixlang config
    --print`` lists them). The engine keeps them as :attr:`config`.

    ``model`` is a registered name, a local folder or ``.gguf`` file, or ``ModelFiles`` (the
    default model when omitted); ``model_path=`` is an alias (SGLang's name), not to be given
    with it. ``dtype`` is the weights' (and by default the KV cache's) dtype: ``"auto"`` (the
    default) picks bfloat16 where the device computes it natively and float32 elsewhere (see
    ``runtime/dtype_choice.py``); :attr:`dtype` says which was chosen.

    ``kv_memory`` (bytes or a size string) or ``num_blocks`` sizes the KV pool; by default it
    takes a share of free memory (see ``kv_cache.default_kv_budget``). With
    ``background=False`` no thread is started and the caller drives ``step()``.
    ``jump_forward`` appends the text a request's grammar forces without decoding it token by
    token; ``overlap_masks`` fills grammar masks on a worker thread while the forward runs.

    ``threads`` is the number of torch intra-op (OpenMP) threads the engine's forward passes
    use; None keeps torch's default. It is set on the engine's own thread (the caller's with
    ``background=False``) before the model loads: OpenMP sizes its thread team per calling
    thread, so setting it on any other thread would not reach the engine's work. torch also
    keeps the value process-wide, as the count for threads that start using torch later.
    ``adapt_threads`` (default: on CPUs when ``threads`` is not given) lowers the count between
    steps while other processes keep cores busy and raises it again after
    (``runtime/cpu_threads.py``): an op split over a core that a neighbour holds waits for it.

    ``quantization="int8"`` holds the layers' linear weights in int8, one scale per output row
    (weight-only; CPUs): a quarter of float32's bytes for the decode step to read.
    ``quantization="gguf"`` (what ``"auto"``, the default, picks for a ``.gguf`` file) keeps a
    GGUF model's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices as the file's blocks, memory-mapped,
    and multiplies them in place (``runtime/models/block_linear.py``); nothing is converted or
    cached but the config and tokenizer.

    ``host_tier_memory`` (bytes or a size string; default none) gives the radix cache a second
    tier: evicted prefixes' KV moves there instead of being dropped and is loaded back when a
    match reaches it (``runtime/host_tier.py``): pinned memory for a GPU pool, a memory-mapped
    file under ``cache_dir`` (or the temp folder) for a CPU pool. ``disk_tier_size`` puts a
    disk tier under it (``runtime/disk_tier.py``: what the host tier would drop is spilled to a
    file). ``prefetch`` (on by default) loads tiered prefixes back on a copy thread before
    their request is admitted (``runtime/tier_prefetch.py``). ``preemption`` is what a
    retracted request's KV becomes: ``"swap"`` (moved to the tier at once and loaded back;
    the default with a tier) or ``"recompute"`` (left in the device cache; the default without).
    ``cache_dir`` also makes the cache persistent: it is saved there at shutdown (and by
    :meth:`save_cache`) and loaded at the next start when the model, dtypes, block size and
    tokenizer are the same (``runtime/cache_store.py``).

    ``grammar_compile_timeout`` (seconds; None for no limit) bounds what compiling one
    request's regex, JSON schema or grammar may cost: a slower one is refused as a bad request
    (compilation runs on the caller's thread, never the engine's).

    ``max_context`` caps the context window below the model's (prompt plus output tokens per
    request), with the same rules as at the model's own limit: longer prompts are refused, and
    so is a ``max_new_tokens`` given that does not fit after the prompt (as SGLang and OpenAI
    answer it); one left unset (the default, 128) is cut to fit. ``allow_auto_truncate``
    (SGLang's name) cuts a given one to fit too, instead of refusing the request.

    ``kv_events`` makes the radix cache announce the blocks it stores and removes
    (``runtime/kv_events.py``; read them with :meth:`kv_events_since`): what a router in
    front of several engines follows to send each request where its prefix is cached.

    ``overlap`` (default: on for CUDA, off elsewhere) runs the forward passes and sampling on a
    device thread and schedules the next decode step, and detokenizes the last one, while a
    step runs (``runtime/overlap.py``). Steps with a prefill chunk, and every step while a
    request needs its tokens at once (a constraint, beam search, penalties, prompt logprobs,
    token healing, a prefill-only request), run one at a time as without it. Not with a host
    tier. ``cuda_graphs`` (default: on for CUDA with the Triton kernels) captures the decode
    forward for a range of batch sizes at start and replays it (``runtime/cuda_graphs.py``).

    ``speculative="ngram"`` (speculative decoding without a draft model; off by default):
    decodes carry drafts from text already there (the request's own, other recent requests'
    of its salt, the radix cache's path after its tokens), computed in the same forward and
    taken as far as the model agrees (``runtime/speculative/``); at most
    ``speculative_num_draft_tokens`` per request and step, as many as its recent acceptance
    pays for on this device: what a step costs is learnt from the engine's steps, or pinned
    with ``speculative_step_cost_ms`` (then the drafts taken do not depend on load).

    ``deterministic`` (deterministic inference): a request's logits, and so its greedy tokens,
    its seeded samples and its logprobs, are bitwise the same whatever else runs in its batch,
    however its prompt is chunked, and whether its prefix came from the cache, the host tier or
    was computed (``LlamaForCausalLM`` says how; ``benchmarks/bench_engine.py --deterministic``
    what it costs).
    """

    def __init__(
        self,
        model: str | Path | ModelFiles | None = None,
        *,
        background: bool = True,
        config: EngineConfig | None = None,
        **settings: Any,
    ) -> None:
        config = _engine_config(model, config, settings)
        self.config = config
        self._max_context_cap = config.max_context
        self.grammar_compile_timeout = config.grammar_compile_timeout
        self.threads = config.threads
        self.deterministic = config.deterministic
        self.allow_auto_truncate = config.allow_auto_truncate
        self.overlap = _choose_overlap(config.overlap, config.device, config.host_tier_memory)
        # How steps run, chosen once (step_loop.py). Overlapped: the device thread runs the
        # model (and loads it: see _build).
        self._stepper: OneAtATime | Overlapped = (Overlapped if self.overlap else OneAtATime)(self)
        if self.overlap:
            # Stopped when the engine goes, or at exit if never shut down: a thread left in
            # torch at interpreter exit aborted the process.
            weakref.finalize(self, self._stepper.close)
            sys.setswitchinterval(min(sys.getswitchinterval(), OVERLAP_SWITCH_INTERVAL_S))
        self.check_integrity_every_step = config.check_integrity_every_step
        # Jump-forward decoding: text a request's grammar forces is appended at once and
        # computed in the next step's extend, instead of one decode step per token.
        self.jump_forward = config.jump_forward
        self._generator = torch.Generator().manual_seed(config.seed)
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._handles: dict[str, RequestHandle] = {}
        self._reqs: dict[str, Req] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._generated_tokens = 0
        self._recent: collections.deque[tuple[float, float, int]] = collections.deque()
        # Programs' call graphs, reported by their backends for viewers (the dashboard).
        self.programs = ProgramLog()
        self._busy_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._went_idle = threading.Event()  # set by the engine thread when it runs out of work
        cache_dir = config.cache_dir
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.cache_load_report: dict[str, Any] | None = None  # what start-up loaded, or why not

        # On the device thread with overlap: the model's thread team belongs to that thread.
        build = functools.partial(self._stepper.run, self._build)
        if background:
            self._start_thread(build)
        else:
            build()

    def _build(self) -> None:
        """Load the model and make the pool, the cache and the scheduler (on the thread that
        will run the forwards)."""
        config = self.config
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # on the thread that runs the forwards
        adapt = config.adapt_threads
        if adapt is None:
            adapt = adapt_by_default(self.threads, torch.device(config.device).type)
        self._governor = ThreadGovernor() if adapt else None
        self.runner = ModelRunner(
            config.model,
            dtype=choose_dtype(config.dtype, config.device),
            device=config.device,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_budget_bytes=parse_memory(config.kv_memory),
            kv_dtype=config.kv_dtype,
            quantization=config.quantization,
            cuda_graphs=config.cuda_graphs,
            deterministic=config.deterministic,
        )
        if self.runner.cuda_graphs:  # now, not at the first decode step (seconds)
            try:
                self.runner.capture_cuda_graphs()
            except Exception as e:
                if config.cuda_graphs:  # asked for outright: say so
                    raise
                # On by default: an engine that runs eagerly beats one that does not start.
                log.warning("CUDA graph capture failed (%s); decoding eagerly", e)
                self.runner.cuda_graphs = False
        cap, model_context = self._max_context_cap, self.runner.max_context
        if cap is not None and cap > model_context:
            raise ValueError(
                f"max_context {cap} exceeds the model's context window of {model_context}"
            )
        self.files = self.runner.files
        self.tokenizer = _load_tokenizer(self.files)
        self.eos_token_ids = admission.eos_token_ids(self.files, self.tokenizer)
        # A reasoning model's <think> / </think> ids: constraints then hold only the answer.
        self.reasoning_markers = reasoning_markers(self.tokenizer)
        self.tool_format = format_for(self.tokenizer, config.tool_call_format)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, copy_hook=self._copy_block)
        self.host_tier = _make_tier(
            self.runner.kv, config.host_tier_memory, config.disk_tier_size, self.cache_dir
        )
        # Retained paths (programs paused at tool calls) may hold this share of the pool.
        retained = int(config.retain_max_share * self.pool.num_blocks)
        self.cache = RadixCache(self.pool, self.host_tier, max_retained_blocks=retained)
        if config.kv_events:
            self.cache.enable_kv_events()
        if self.host_tier is not None and config.prefetch:
            self.cache.copier = TierCopier()  # tier loads on a thread of their own
        # On by default, on CPU too (default model, float32, batch 32, the JSON workload of
        # benchmarks/bench_structured.py): a step waits p99 0.1 ms for its masks instead of
        # 5 ms, and in alternating runs decode went at a median 150 tok/s against 136.
        self._masks = MaskFiller(config.overlap_masks)
        batch_tokens = config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(
            self.runner.device.type, 2048
        )
        # Speculative decoding: drafts from the text already there (runtime/speculative).
        self.drafter: Drafter | None = None
        if config.speculative == "ngram":
            pinned = config.speculative_step_cost_ms
            if pinned is not None:  # fixed: drafts follow the requests, not the machine's load
                c0, c1, c2 = (ms / 1e3 for ms in pinned)
                cost = StepCost((c0, c1, c2), learn=False)
            else:
                cost = StepCost(GPU_PRIOR if self.runner.device.type == "cuda" else CPU_PRIOR)
            self.drafter = Drafter(self.cache, cost, config.speculative_num_draft_tokens)
        self.scheduler = Scheduler(
            self.pool,
            self.cache,
            batch_tokens,
            config.max_running_requests,
            config.schedule_policy,
            sliding_window=self.runner.sliding_window,
            preemption=config.preemption or ("swap" if self.host_tier is not None else "recompute"),
            drafter=self.drafter,
        )
        self._outputs = RequestOutputs(
            self.scheduler,
            self._handles,
            self._detokenizers,
            self._reqs,
            self._lock,
            self._stepper.finished,
        )
        self._rows = SamplingRows(
            self._masks, self._outputs.stop_done, self._outputs.fail_constraint
        )
        self._verifier = (
            DraftVerifier(
                self.scheduler,
                self._outputs,
                self._rows,
                self.drafter,
                lambda: self._generator,
                lambda: self.jump_forward,
            )
            if self.drafter is not None
            else None
        )
        if self.cache_dir is not None:
            self._load_saved_cache()

    def _start_thread(self, build: Callable[[], None]) -> None:
        """Start the engine thread, which builds the engine and then runs its loop; return once
        it is built (raising what building raised).

        The engine thread loads the model too, so that all the engine's torch work runs on one
        thread: libgomp throttles its workers' spinning once a second thread owns an OpenMP
        team, which cost a quarter of the CPU decode speed when the caller's thread had loaded
        the model."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def boot() -> None:
            try:
                build()
            except BaseException as e:
                failure.append(e)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=boot, name="radixlang-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        _live_engines.add(self)  # shut down at interpreter exit if still running then

    # ---- public API ------------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        """The context window requests get: the model's, or the ``max_context`` cap."""
        cap = self._max_context_cap
        return self.runner.max_context if cap is None else min(cap, self.runner.max_context)

    @property
    def dtype(self) -> str:
        """The weights' dtype, as chosen (``"auto"`` resolved): ``"float32"``, ``"bfloat16"``."""
        return str(self.runner.dtype).removeprefix("torch.")

    @property
    def overlap_masks(self) -> bool:
        """Whether grammar masks are filled on a worker thread while the forward runs."""
        return self._masks.overlap

    @overlap_masks.setter
    def overlap_masks(self, value: bool) -> None:
        self._masks.overlap = bool(value)  # read at the start of each step

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (read without a lock: a close estimate)."""
        return len(self.scheduler.waiting) + sum(kind == "add" for kind, _ in list(self._inbox))

    @property
    def is_running(self) -> bool:
        """Whether the engine takes requests: not shut down, its thread (if any) alive."""
        return not self._closed and (self._thread is None or self._thread.is_alive())

    def submit(
        self,
        request: GenerateRequest | Prompt,
        sampling: SamplingParams | dict | None = None,
        *,
        request_id: str | None = None,
        on_event: EventCallback | None = None,
        cache_salt: str | None = None,
        on_result: ResultCallback | None = None,
    ) -> RequestHandle:
        """Queue a request; thread-safe. Bad requests raise ``RequestError`` here.
        ``on_event`` and ``on_result`` are called on the engine thread with each stream event
        and the result.

        ``cache_salt`` (else ``request.cache_salt``): the request reuses only prefixes cached
        by requests with the same salt."""
        request = as_request(request, sampling, request_id)
        salt = request.cache_salt if cache_salt is None else cache_salt
        req, detokenizer = admission.admit(self, request, salt)
        rid = req.rid
        handle = RequestHandle(rid, self.abort, on_event, on_result)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            if rid in self._handles:
                raise RequestError(f"request_id {rid!r} is already in use by a live request")
            self._handles[rid] = handle
            self._inbox.append(("add", (req, detokenizer)))
        self._wake.set()
        return handle

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Complete one prompt (a string or token ids) or a list of them; waits for all."""
        single = isinstance(prompts, str) or (
            len(prompts) > 0 and isinstance(prompts[0], int)  # type: ignore[index]
        )
        batch = [prompts] if single else list(prompts)  # type: ignore[list-item]
        params = sampling if isinstance(sampling, list | tuple) else [sampling] * len(batch)
        if len(params) != len(batch):
            raise RequestError(f"{len(batch)} prompts but {len(params)} sampling parameter sets")
        if self._thread is not None and self._on_engine_thread():
            raise RuntimeError(
                "generate() waits for the engine thread and cannot run on it (from on_event): "
                "use submit() there"
            )
        handles = []
        try:
            handles = [self.submit(p, s) for p, s in zip(batch, params, strict=True)]
            if self._thread is None:
                while not all(h.done for h in handles):
                    self.step()
            results = [h.result() for h in handles]
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return results[0] if single else results

    def release_retained(self, program: str) -> int:
        """End the retentions of ``program``'s paths (it ended: nothing will resume them);
        returns how many paths it had retained."""

        def release() -> int:
            self.scheduler.return_times.ended(program)
            return self.cache.release(program)

        return self._call(release)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are released (a no-op once finished)."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def flush_cache(self, wait: float | None = 0.0) -> bool:
        """Drop every cached prefix (the KV that finished requests left); returns True.

        A flush happens only while no request is queued or running. With requests in flight it
        waits up to ``wait`` seconds (None: as long as they take) for them to finish, then
        flushes; if some are still in flight then, it raises :class:`CacheBusyError` and
        flushes nothing. With ``background=False`` the wait runs the engine's steps itself;
        called on the engine thread (an ``on_event`` callback) it cannot wait at all."""
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0
        ):
            raise ValueError(f"flush_cache(wait=...) takes None or seconds >= 0, got {wait!r}")
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            self._went_idle.clear()
            busy = self._call(self._flush_if_idle)
            if busy is None:
                return True
            thread = self._thread
            remaining = None if deadline is None else deadline - time.monotonic()
            cannot_wait = (thread is not None and self._on_engine_thread()) or (
                thread is not None and not thread.is_alive()
            )
            if cannot_wait or (remaining is not None and remaining <= 0):
                running, waiting = busy
                waited = f" after waiting {wait:g} s" if wait else ""
                raise CacheBusyError(
                    f"cannot flush the cache{waited}: {running} running and {waiting} waiting "
                    "requests are in flight; flush_cache(wait=seconds) waits for them to finish, "
                    "abort(request_id) stops one"
                )
            if thread is None:
                self.step()
            else:
                self._went_idle.wait(0.05 if remaining is None else min(remaining, 0.05))

    def _flush_if_idle(self) -> tuple[int, int] | None:
        """Flush unless requests are in flight; None when flushed, else (running, waiting)."""
        if self.scheduler.has_work():
            return len(self.scheduler.running), len(self.scheduler.waiting)
        self.cache.flush()
        if self.drafter is not None:  # the other requests' text it drafts from goes too
            self.drafter.forget()
        return None

    def check_integrity(self) -> None:
        """Check the pool, the cache and the requests on the engine thread; raises on a fault."""
        self._call(self.scheduler.check_integrity)

    def stats(self) -> dict[str, float | int]:
        """Requests, blocks, cached tokens, prompt tokens computed vs reused, throughput.

        Instantaneous (the state now): ``running_requests``, ``waiting_requests``,
        ``blocks_total``, ``blocks_free``, ``blocks_used``, ``blocks_evictable``,
        ``cached_tokens`` (tokens in the radix cache) and ``tokens_per_second`` (tokens
        generated over the steps of the last 10 seconds).

        Cumulative since the engine started, or since the last :meth:`reset_stats`: ``steps``,
        ``generated_tokens``, ``finished_requests`` and ``finished_<reason>`` (stop, length,
        abort, error), ``prompt_tokens`` (of admitted requests), ``prompt_tokens_reused`` (from
        the cache), ``prompt_tokens_computed``, ``recomputed_tokens`` (again after a
        retraction), ``retractions``, ``evicted_blocks``, ``jump_forward_tokens``,
        ``jump_forward_jumps``, ``overlapped_steps``; and figures derived from them:
        ``cache_hit_rate`` (reused / prompt tokens), ``busy_tokens_per_second`` (generated
        tokens / time spent in steps), and ``grammar_mask_steps`` with the p50/p99
        ``grammar_mask_ms_*`` and ``grammar_mask_wait_ms_*`` (over the last 2048 steps with
        constrained rows).
        ``cpu_threads`` is the forward passes' thread count now; with adaptive threads
        ``cpu_thread_changes`` counts its changes and ``other_cores_busy`` is what other
        processes used at the last look.

        Read on the engine thread (between steps) while it runs, so the figures are those of
        whole steps: a caller whose request just finished sees that step's tokens counted."""
        if self._thread is not None and self._thread.is_alive() and not self._closed:
            return self._call(self._stats)
        return self._stats()

    def reset_stats(self) -> None:
        """Zero the cumulative figures of :meth:`stats` (a benchmark measuring one run); the
        instantaneous ones describe the engine's state and are left as they are. Runs on the
        engine thread between steps, so no step is counted half before and half after."""
        if self._thread is not None and self._thread.is_alive() and not self._closed:
            self._call(self._reset_stats)
        else:
            self._reset_stats()

    def _reset_stats(self) -> None:
        self.scheduler.reset_counters()
        self._generated_tokens = 0
        self._outputs.reset_counts()
        self._busy_seconds = 0.0
        self._stepper.overlapped_steps = 0
        self._masks.reset()
        if self.drafter is not None:
            self.drafter.reset_stats()

    def _stats(self) -> dict[str, float | int]:
        s = self.scheduler.stats()
        now = time.perf_counter()
        recent = [(t0, n) for t0, t1, n in list(self._recent) if now - t1 <= THROUGHPUT_WINDOW_S]
        s["generated_tokens"] = self._generated_tokens
        outputs = self._outputs
        s["finished_requests"] = outputs.finished_requests
        for reason in FinishReason:
            s[f"finished_{reason.value}"] = outputs.finished_by_reason[reason]
        # Over the steps of the last few seconds, from the first one's start to now.
        span = now - recent[0][0] if recent else 0.0
        s["tokens_per_second"] = sum(n for _, n in recent) / span if span > 0 else 0.0
        s["busy_tokens_per_second"] = (
            self._generated_tokens / self._busy_seconds if self._busy_seconds else 0.0
        )
        # Jump-forward: tokens appended without a decode step of their own (each one a forward
        # pass that request did not need), and how many jumps carried them.
        s["jump_forward_tokens"] = outputs.jump_forward_tokens
        s["jump_forward_jumps"] = outputs.jump_forward_jumps
        # Overlapped scheduling: steps submitted without waiting for the one before.
        s["overlapped_steps"] = self._stepper.overlapped_steps
        # Grammar masks: time to fill a step's masks, and how long the step waited for them
        # after its forward (less than the fill time when they were filled beside it).
        s.update(self._masks.percentiles_ms())
        # The host tier: what it holds now, and its traffic since start ("_total").
        s.update(self.cache.tier_stats())
        # Retention: the paths programs paused at tool calls keep, and what eviction took.
        s.update(self.cache.retention_stats())
        s.update(self.scheduler.return_times.stats())
        # Speculative decoding: drafts verified and accepted.
        if self.drafter is not None:
            s.update(self.drafter.stats())
        # CPU threads of the forward passes now, and how often the governor changed them.
        s["cpu_threads"] = torch.get_num_threads()
        if self._governor is not None:
            s["cpu_thread_changes"] = self._governor.changes
            s["other_cores_busy"] = round(self._governor.other_cores_busy, 2)
        return s

    def render_cache(self, max_nodes: int = 50) -> str:
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return self._call(lambda: self.cache.render(decode=decode, max_nodes=max_nodes))

    def view(self, max_nodes: int = 150) -> dict[str, Any]:
        """What a viewer shows, read between two steps: ``stats`` (as :meth:`stats`), ``tree``
        (the radix tree's ``max_nodes`` largest nodes, the latest evictions), ``blocks`` (each
        block's state and holder) and ``requests`` (running, then waiting). Token ids are left
        undecoded: see ``runtime/engine_view.py`` and the server's ``dashboard``."""

        def read() -> dict[str, Any]:
            states, owners, names = block_owners(self.pool, self.cache, self.scheduler.running)
            return {
                "stats": self._stats(),
                "tree": tree_view(self.cache, max_nodes),
                "blocks": {"states": states, "owners": owners, "names": names},
                "requests": request_rows(self.scheduler.running, self.scheduler.waiting),
            }

        return self._call(read)

    @property
    def kv_events_enabled(self) -> bool:
        return self.cache.kv_events is not None

    def kv_events_since(self, seq: int) -> tuple[list[KvEvent], bool]:
        """The KV events after number ``seq`` (any thread), and whether the log dropped some
        of them (then rebuild from :meth:`kv_block_hashes`). Empty without ``kv_events``."""
        log_ = self.cache.kv_events
        return log_.since(seq) if log_ is not None else ([], False)

    def kv_block_hashes(self) -> tuple[int, list[tuple[int, list[int]]]]:
        """The last KV event's number and every cached block's hash then (per node: salt
        seed, hashes), read between two steps: where a consumer that fell behind restarts."""

        def read() -> tuple[int, list[tuple[int, list[int]]]]:
            log_ = self.cache.kv_events
            return (log_.last_seq if log_ else 0), self.cache.block_hashes()

        return self._call(read)

    def kv_block_media(self) -> tuple[int, list[tuple[int, list[int], str]]]:
        """:meth:`kv_block_hashes` with each node's medium (``device``, ``host``): (salt seed,
        hashes, medium) per node."""

        def read() -> tuple[int, list[tuple[int, list[int], str]]]:
            log_ = self.cache.kv_events
            return (log_.last_seq if log_ else 0), self.cache.block_media()

        return self._call(read)

    def memory_report(self) -> MemoryReport:
        """Where the KV memory goes now: blocks by holder, live vs allocated slots, sharing,
        the host tier and the bookkeeping overhead (``runtime/memory_report.py``)."""
        return self._call(
            lambda: collect_memory_report(
                self.pool, self.cache, self.scheduler.running, self.runner.kv
            )
        )

    def save_cache(self, folder: str | Path | None = None) -> dict[str, int]:
        """Save the radix cache (its tree and KV, device and tier) to ``folder`` (by default
        ``cache_dir``); returns the nodes, tokens and bytes written. Requests keep running."""
        target = Path(folder).expanduser() if folder is not None else self.cache_dir
        if target is None:
            raise ValueError("save_cache needs a folder: give one, or start with cache_dir")
        return self._call(lambda: self._save_cache(target))

    def _save_cache(self, folder: Path | None = None) -> dict[str, int]:
        folder = folder if folder is not None else self.cache_dir
        assert folder is not None
        saved = cache_store.save(self.cache, self.runner.kv, folder, self._fingerprint())
        log.info("saved the radix cache to %s: %s", folder, saved)
        return saved

    def _load_saved_cache(self) -> None:
        assert self.cache_dir is not None
        try:
            loaded = cache_store.load(
                self.cache, self.runner.kv, self.cache_dir, self._fingerprint()
            )
        except cache_store.CacheFileError as e:
            self.cache_load_report = {"loaded": False, "reason": str(e)}
            if (self.cache_dir / cache_store.FILE_NAME).exists():
                log.warning("saved radix cache not used: %s", e)
            return
        self.cache_load_report = {"loaded": True, **loaded}
        log.info("loaded the radix cache from %s: %s", self.cache_dir, loaded)

    def _fingerprint(self) -> dict[str, Any]:
        return cache_store.fingerprint(self.files.path, self.runner.kv, self.dtype)

    def shutdown(self, free_cache: bool = False) -> None:
        """Stop the engine thread; requests still in flight finish with ``abort``.

        ``free_cache`` then drops the cached prefixes too and checks that every block is free
        (a server's last act: nothing may stay held)."""
        with self._lock:
            closing = not self._closed
            self._closed = True
        _live_engines.discard(self)
        self._wake.set()
        if self._thread is not None and self._on_engine_thread():
            return  # called from a callback: the loop ends after this step
        if closing and self._thread is not None:
            self._thread.join()
        elif closing:
            self._abort_all()
        self._masks.close()
        self._stepper.close()
        if self.cache.copier is not None:
            self._call(lambda: self.cache.settle_loads(wait=True))
            self.cache.copier.close()
        if closing and self.cache_dir is not None:
            try:
                self._save_cache()
            except Exception as e:  # a failed save must not stop the shutdown
                log.warning("could not save the radix cache to %s: %s", self.cache_dir, e)
        if free_cache:
            self.cache.flush()
            self.scheduler.check_integrity()
            if self.pool.num_free != self.pool.num_blocks:
                raise RuntimeError(
                    f"{self.pool.num_blocks - self.pool.num_free} KV blocks still held after "
                    "shutdown and a cache flush"
                )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the step --------------------------------------------------------------------------
    @property
    def _inflight(self) -> InflightStep | None:
        """The step submitted to the device thread and not yet taken (overlap only)."""
        return self._stepper.inflight

    def step(self) -> bool:
        """Run one scheduling step and forward pass; False when there was nothing to do.

        With ``overlap`` the step's forward is submitted, not waited for: the tokens it
        samples come out in the next step (or whenever the engine next needs them)."""
        self._drain_inbox()
        if self._governor is not None:
            self._stepper.submit(self._governor.update)  # the team of the thread that runs
        return self._stepper.step(time.perf_counter())

    def _check_step(self) -> None:
        if self.check_integrity_every_step:
            self.scheduler.check_integrity()

    def _account(self, started: float, new_tokens: int) -> None:
        now = time.perf_counter()
        self._busy_seconds += now - started
        self._generated_tokens += new_tokens
        self._recent.append((started, now, new_tokens))
        while self._recent and now - self._recent[0][1] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def _run_batch(self, chunks: list[Chunk]) -> int:
        """Compute and sample ``chunks`` now; a failure fails their requests, not the engine."""
        try:
            return self._run(chunks)
        except Exception as e:  # fail this batch's requests; keep serving the others
            log.exception("engine step failed")
            self._outputs.fail_chunks(chunks, e)
            return 0

    # ---- overlap (runtime/overlap.py) --------------------------------------------------------
    def _copy_block(self, src: int, dst: int, num_slots: int) -> None:
        """The pool's copy-on-write: with overlap, queued behind the steps already submitted
        (``dst`` may be a block a running step still writes, freed by a request that stopped)."""
        self._stepper.submit(functools.partial(self.runner.copy_block, src, dst, num_slots))

    def _run(self, chunks: list[Chunk]) -> int:
        seqs = []
        for chunk in chunks:
            req = chunk.req
            start = chunk.start
            scored = req.next_prompt_logprob >= 0 and start < len(req.prompt_ids)
            tokens = req.tokens[start : chunk.end]
            seqs.append(
                SequenceInput(
                    tokens + chunk.draft if chunk.draft else tokens,
                    start,
                    req.blocks,
                    scored,
                    req.params.top_logprobs_num if scored else 0,
                    all_logits=bool(chunk.draft),
                )
            )
        self._rows.prefetch(chunks, self.runner.vocab_size)
        started = time.perf_counter()
        try:
            out = self.runner.forward(seqs)
            self._masks.wait()  # before anything touches a constraint again
            return self._finish_run(chunks, seqs, out)
        finally:
            self._masks.settle()  # nothing may fill masks while constraints advance
            if self.drafter is not None and all(_decoding(c) for c in chunks):
                # What a decode step costs, for the drafts' cost rule.
                tokens = sum(1 + len(c.draft) for c in chunks)
                self.drafter.cost.observe(len(chunks), tokens, time.perf_counter() - started)

    def _finish_run(self, chunks: list[Chunk], seqs: list[SequenceInput], out: Any) -> int:
        sampled: list[int] = []
        commit = self.scheduler.commit
        for i, chunk in enumerate(chunks):
            req = chunk.req
            commit(chunk)
            if seqs[i].return_logprobs:
                token_output.collect_prompt_logprobs(chunk, out.logits[i], out, i)
            tokens = len(req.tokens)
            if chunk.end < tokens:
                continue  # a prefill chunk: more of the prompt to come
            if tokens - len(req.prompt_ids) < req.output_limit:
                sampled.append(i)
            else:  # prefill only: the prompt is cached now
                self.scheduler.finish(req, FinishReason.LENGTH)
                self._outputs.complete(req)
        sampled, beam_rows = split_beam_rows(chunks, sampled)
        beam_tokens = self._outputs.advance_beams(chunks, beam_rows, out.logits) if beam_rows else 0
        if self._verifier is not None and any(chunks[i].draft for i in sampled):
            return beam_tokens + self._verifier.take(chunks, sampled, out)
        sampled, rows = self._rows.for_step(chunks, sampled, out.logits.shape[-1])
        if not sampled:
            return beam_tokens
        logits = out.logits
        if sampled[-1] != len(sampled) - 1:  # rows left out: gather the sampled ones
            logits = logits[sampled]
        elif len(sampled) != logits.shape[0]:  # the first rows: a view, no copy
            logits = logits[: len(sampled)]
        picks = sample(logits, rows, self._generator)
        appended = len(sampled)
        jump_forward = self.jump_forward
        append = self._outputs.append
        token_ids, logprobs, top_logprobs = picks.token_ids, picks.logprobs, picks.top_logprobs
        for row, i in enumerate(sampled):
            req = chunks[i].req
            append(req, token_ids[row], logprobs[row], top_logprobs[row])
            if jump_forward and req.constraint is not None and req.finish_reason is None:
                appended += self._outputs.jump_forward(req)
        return appended + beam_tokens

    # ---- the thread and its inbox ----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._drain_inbox()
            if self._closed:
                break
            if self.scheduler.has_work() or self._stepper.inflight is not None:
                try:
                    self.step()
                except Exception as e:  # a fault outside any one request's model run
                    log.exception("engine step failed outside the model run")
                    self._fail_all(e)
            else:
                self._went_idle.set()  # a flush_cache waiting for the requests to end may go
                # Idle, a paused program's predicted return may still call for a prefetch.
                due = self.scheduler.next_prefetch_in()
                if due is not None and due <= 0:
                    self._prefetch_due()
                    continue
                self._wake.wait(due)
                self._wake.clear()
        self._abort_all()

    def _prefetch_due(self) -> None:
        try:
            self.scheduler.prefetch_due()
            self.cache.settle_loads()
        except Exception:  # a failed copy costs a recompute later, not the engine
            log.exception("tier prefetch failed")

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                req, detokenizer = item
                self._reqs[req.rid] = req
                if detokenizer is not None:
                    self._detokenizers[req.rid] = detokenizer
                self._stepper.admitted(req)
                self.scheduler.add(req)
                continue
            # Aborts and calls see every request between steps, as without overlap.
            self._stepper.fence()
            if kind == "abort":
                req = self._reqs.get(item)
                if req is not None and req.finish_reason is None:
                    self.scheduler.finish(req, FinishReason.ABORT)
                    self._outputs.complete(req)
            else:  # "call": run a function on the engine thread
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)

    def _on_engine_thread(self) -> bool:
        """On the engine thread, or on the device thread running a step for it (a callback)."""
        current = threading.current_thread()
        return current is self._thread or current is self._stepper.thread

    def _call(self, fn: Callable[[], T]) -> T:
        thread = self._thread
        if thread is None or self._on_engine_thread() or not thread.is_alive():
            self._drain_inbox()
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.append(("call", (fn, future)))
        self._wake.set()
        return future.result()

    def _fail_all(self, error: Exception) -> None:
        """Fail every queued and running request with ``error``; the engine then goes on."""
        message = f"{type(error).__name__}: {error}"
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.error = message
            try:
                self.scheduler.finish(req, FinishReason.ERROR, cache_kv=False)
            except Exception:  # the state that failed may not release cleanly: drop the request
                log.exception("could not release request %s", req.rid)
                for queue in (self.scheduler.running, self.scheduler.waiting):
                    if req in queue:
                        queue.remove(req)
                req.finish_reason = FinishReason.ERROR
            self._outputs.complete(req)

    def _abort_all(self) -> None:
        self._drain_inbox()
        self._stepper.fence()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, FinishReason.ABORT)
            self._outputs.complete(req)


def _decoding(chunk: Chunk) -> bool:
    """A decode (with or without a draft): one token after the prompt."""
    return chunk.end - chunk.start == 1 and chunk.start >= len(chunk.req.prompt_ids)


def _make_tier(
    kv: KVCache, host_memory: int | str | None, disk_size: int | str | None, folder: Path | None
) -> HostTier | SpillingTier | None:
    """The radix cache's tier: host memory, with a disk tier under it when asked."""
    host_bytes = parse_memory(host_memory)
    disk_bytes = parse_memory(disk_size)
    if disk_bytes and not host_bytes:
        raise ValueError("disk_tier_size needs a host tier above it: set host_tier_memory too")
    if not host_bytes:
        return None
    if not disk_bytes:
        return HostTier.from_budget(kv, host_bytes, folder)
    per_block = kv.shape.bytes_per_block(kv.block_size, kv.dtype)
    if min(host_bytes, disk_bytes) < per_block:
        raise ValueError(f"host_tier_memory and disk_tier_size must each hold a KV block "
                         f"({per_block} bytes)")  # fmt: skip
    return SpillingTier(kv, host_bytes // per_block, disk_bytes // per_block, folder)


def _choose_overlap(
    overlap: bool | None, device: str | torch.device, host_tier_memory: int | str | None
) -> bool:
    tier = bool(parse_memory(host_tier_memory))
    if overlap and tier:
        raise ValueError(
            "overlap does not run with a host tier: moving KV between tiers waits for each step"
        )
    if overlap is None:
        return torch.device(device).type == "cuda" and not tier
    return overlap


def _engine_config(
    model: str | Path | ModelFiles | None, config: EngineConfig | None, settings: dict[str, Any]
) -> EngineConfig:
    """The engine's config: ``config`` as given, or one made from the keyword arguments."""
    if "model_path" in settings:  # SGLang's name for model
        model_path = settings.pop("model_path")
        if model is not None and model_path is not None:
            raise TypeError(
                "Engine() got both model and model_path: they name the same argument "
                "(model_path is SGLang's name for it), give one"
            )
        model = model if model is not None else model_path
    if config is not None:
        if model is not None or settings:
            raise TypeError("Engine(config=...) takes no other settings: put them in the config")
        return config
    unknown = sorted(set(settings) - set(ENGINE_KEYS))
    if unknown:
        raise TypeError(
            f"Engine() got an unexpected keyword argument {unknown[0]!r}"
            f"{did_you_mean(unknown[0], ENGINE_KEYS)}"
        )
    if model is not None:
        settings["model"] = model
    return EngineConfig(**settings)


def _signature() -> inspect.Signature:
    """``Engine``'s signature as help and IDEs show it: a parameter per setting."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
            inspect.Parameter("model_path", keyword, default=None),
            *(inspect.Parameter(key, keyword, default=s.default) for key, s in ENGINE_KEYS.items()
              if key != "model"),
            inspect.Parameter("background", keyword, default=True),
            inspect.Parameter("config", keyword, default=None),
        ]
    )  # fmt: skip


Engine.__signature__ = _signature()  # type: ignore[attr-defined]


def load_tokenizer(files: ModelFiles) -> Any | None:
    """The model's tokenizer as an engine loads it (None for a model without one)."""
    return _load_tokenizer(files)


def _load_tokenizer(files: ModelFiles) -> Any | None:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((files.path / name).exists() for name in names):
        return None
    return files.load_tokenizer()
