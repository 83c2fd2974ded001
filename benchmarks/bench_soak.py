"""Soak: thousands of requests from many loopback clients over every route, on a KV pool far
smaller than the working set, while clients vanish, requests are aborted and faults are
injected inside the server. Nothing may be lost and nothing may leak.

One command:  .venv/bin/python benchmarks/bench_soak.py [--requests 2000] [--clients 100]
Writes benchmarks/results/bench_soak.json and .png (``--quick``: 300 requests, 30 clients).

The server is ``serve_in_thread`` over the tiny random chat model (the default model's
tokenizer and chat template, float32, so a greedy output does not depend on its batch), so that
the run measures the serving machinery, not model arithmetic, and so that faults can be put
into its engine. The run:

1. **References.** Each distinct request (``--specs``; native ``/generate`` plain, streamed,
   batched and regex-constrained, ``/v1/completions`` and ``/v1/chat/completions`` plain and
   streamed; prompts in families that share system prompts) is sent alone, one after another,
   to a server with a pool large enough to cache them all. Its text is the reference, and the
   blocks the cache then holds are the *working set*.
2. **Soak.** A second server whose pool is ``--pool-fraction`` (25%) of the working set gets
   ``--requests`` requests, each a distinct request drawn at random, from ``--clients``
   concurrent clients (one ``httpx.AsyncClient`` each), mixed with the light routes (health,
   metrics, memory, tokenize, detokenize, model info, ``/flush_cache`` while busy, which must
   answer 400) and malformed bodies (which must answer 4xx). ``--disconnect`` (20%) of the
   requests are dropped by their client at a random moment; some native ones are aborted
   through ``/abort_request`` at a random moment. Faults injected meanwhile
   (:class:`FaultInjector`): a model run raises when it holds a marked request (the plan marks
   one request in 400, at least one: how many fail does not depend on how the requests were
   batched); the tokenizer raises on prompts that carry a marker; a constraint raises as it
   takes a token (at a rate, and at once for marked requests); the KV pool refuses an
   allocation; and ``--slow-clients`` clients start long streams and then stop reading them.
3. **Checks.** Every request that was not aborted, dropped or faulted answered 200 with exactly
   its reference text; every aborted one ended with a prefix of it; every faulted one got an
   error that names the injected fault (a 500, or an error event in its stream), and each
   failed model run's requests are the only ones that report one; allocation refusals fail
   nothing. While the slow clients still hold their streams unread, the engine has finished
   their requests and is idle. Afterwards no block is held, integrity holds and a flush frees
   the whole pool.

Reported: outcomes by kind, faults injected by kind, latency p50/p99 and throughput (requests/s,
output tokens/s) of the completed requests, the resident memory of this process (server and
clients together) before and after, and the engine's retractions and evictions. The clients
run in this process too, so they take CPU time from the server, as any client on the same host
does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_server import percentile  # a sibling module, as when run as a script
from provenance import provenance

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
FAULT = "InjectedFault"
TOKENIZER_MARKER = "[tokenizer-fault]"  # a prompt with it makes the tokenizer raise
FORWARD_FAULT_RID = "forward-fault-"  # a request whose id starts so fails its model run
CONSTRAINT_FAULT_REGEX = "(injectedfault|[0-9]{2,6})"  # a constraint from it fails at once
# Requests per marked one of each kind (a failed model run, a failed constraint): the faults a
# run injects follow from its plan, not from how many model runs its batching took (that count
# depends on the machine's speed).
MARKED_EVERY = 400
BLOCK_SIZE = 16
SLOW_TOKENS = 200  # a slow client's stream: about 1 MB of events (cumulative text, logprobs)

SYSTEMS = [
    "You are a terse assistant. Answer in one line.",
    "You are a patient tutor at a public library's homework help desk. Students ask about "
    "science, history and music; answer in plain words with one concrete example.",
    "You are a ship's navigator in the age of sail. Speak of stars, currents and weather, and "
    "never of engines. Keep every answer to a few short sentences.",
    "You review code. Point out one bug, one style issue and one thing done well, in order.",
]
QUESTIONS = ["Why is the sea salty?", "Name a prime number.", "What is rust?",
             "Describe a cat.", "How far away is the moon?", "Sing a short song.",
             "What is 2 + 2?", "Who wrote Hamlet?", "Explain tides.",
             "What is a list?"]  # fmt: skip
REGEXES = ["[0-9]{2,6}", "(yes|no|maybe)", "[a-z]{3,9}( [a-z]{2,6}){0,3}", "[A-Z][a-z]{2,8}"]
KINDS = ("native", "native_stream", "native_batch", "native_regex", "completion",
         "completion_stream", "chat", "chat_stream")  # fmt: skip


class InjectedFault(RuntimeError):
    """A fault the soak puts into the server; every error it causes names this class."""


# ---- the requests --------------------------------------------------------------------------
@dataclass
class Spec:
    """One distinct request: its route, body and how to read its answer."""

    index: int
    kind: str
    route: str
    body: dict[str, Any]
    reference: str | None = None  # the text it gets alone


def make_specs(n: int, seed: int, max_new_tokens: int = 24) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        system, question = rng.choice(SYSTEMS), f"{rng.choice(QUESTIONS)} (#{i})"
        tokens = rng.randrange(4, max_new_tokens + 1)
        sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        if kind.startswith("native"):
            body: dict[str, Any] = {"text": f"{system}\n{question}", "sampling_params": sampling}
            if kind == "native_stream":
                body["stream"] = True
            elif kind == "native_batch":
                body["text"] = [body["text"], f"{system}\n{question} Again."]
            elif kind == "native_regex":
                sampling["regex"] = rng.choice(REGEXES)
                sampling["ignore_eos"] = False
            specs.append(Spec(i, kind, "/generate", body))
            continue
        common = {"model": "default", "max_tokens": tokens, "temperature": 0,
                  "ignore_eos": True}  # fmt: skip
        if kind.startswith("completion"):
            body = {**common, "prompt": f"{system}\n{question}"}
            route = "/v1/completions"
        else:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": question}]  # fmt: skip
            body = {**common, "messages": messages}
            route = "/v1/chat/completions"
        if kind.endswith("_stream"):
            body["stream"] = True
        specs.append(Spec(i, kind, route, body))
    return specs


@dataclass
class Answer:
    """What a client got: the status, the text (batch items joined), an error message."""

    status: int
    text: str = ""
    error: str | None = None
    finish: str | None = None  # native meta_info.finish_reason.type or OpenAI finish_reason
    tokens: int = 0  # output tokens, where the answer says


def _error(data: Any) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return None


def _read_json(kind: str, data: Any) -> Answer:
    error = _error(data)
    if error is not None:
        return Answer(200, error=error)
    if kind == "native_batch":
        return Answer(200, "\x00".join(d["text"] for d in data),
                      finish=data[0]["meta_info"]["finish_reason"]["type"],
                      tokens=sum(d["meta_info"]["completion_tokens"] for d in data))  # fmt: skip
    if kind.startswith("native"):
        meta = data["meta_info"]
        return Answer(200, data["text"], finish=meta["finish_reason"]["type"],
                      tokens=meta["completion_tokens"])  # fmt: skip
    choice = data["choices"][0]
    text = choice["text"] if kind.startswith("completion") else choice["message"]["content"]
    return Answer(200, text or "", finish=choice["finish_reason"],
                  tokens=data["usage"]["completion_tokens"])  # fmt: skip


async def _read_stream(kind: str, response: httpx.Response) -> Answer:
    answer = Answer(response.status_code)
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        error = _error(chunk)
        if error is not None:
            answer.error = error
            continue
        if kind == "native_stream":
            answer.text = chunk["text"]  # cumulative
            answer.finish = (chunk["meta_info"].get("finish_reason") or {}).get("type")
            answer.tokens = chunk["meta_info"]["completion_tokens"]
            continue
        for c in chunk["choices"]:
            answer.text += (c.get("text") if kind == "completion_stream"
                            else c["delta"].get("content")) or ""  # fmt: skip
            answer.finish = c.get("finish_reason") or answer.finish
            answer.tokens += 1 if (c.get("text") or c.get("delta", {}).get("content")) else 0
    return answer


async def send(client: httpx.AsyncClient, spec: Spec, body: dict | None = None) -> Answer:
    body = spec.body if body is None else body
    if not body.get("stream"):
        response = await client.post(spec.route, json=body)
        try:
            data = response.json()
        except ValueError:
            return Answer(response.status_code, error=response.text[:200])
        answer = _read_json(spec.kind, data) if response.status_code == 200 else None
        return answer or Answer(response.status_code, error=_error(data) or str(data)[:200])
    async with client.stream("POST", spec.route, json=body) as response:
        if response.status_code != 200:
            data = json.loads(await response.aread())
            return Answer(response.status_code, error=_error(data) or str(data)[:200])
        return await _read_stream(spec.kind, response)


# ---- faults --------------------------------------------------------------------------------
@dataclass
class FaultInjector:
    """Faults put into a live engine (its own attributes are patched; :meth:`remove` undoes
    it): a model run raises when it holds a request whose id starts with
    :data:`FORWARD_FAULT_RID` (and with it every request of the run fails); an allocation and a
    constrained token fail at their rates, and a constraint of :data:`CONSTRAINT_FAULT_REGEX`
    on its first token; the tokenizer raises on every prompt that carries
    :data:`TOKENIZER_MARKER`."""

    engine: Any
    alloc_rate: float = 0.05
    constraint_rate: float = 0.1
    seed: int = 0
    counts: Counter = field(default_factory=Counter)
    model_runs: int = 0
    failed_rids: set[str] = field(default_factory=set)  # the requests of failed model runs
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def install(self) -> FaultInjector:
        rng = random.Random(self.seed)
        eng, lock = self.engine, threading.Lock()

        def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            self._undo.append(lambda: delattr(owner, name) if name in vars(owner) else None)

        def forward(run: Any) -> Any:
            def faulty(chunks: Any) -> Any:
                self.model_runs += 1  # (the engine thread is the only caller)
                if any(c.req.rid.startswith(FORWARD_FAULT_RID) for c in chunks):
                    self.counts["forward"] += 1
                    self.failed_rids.update(c.req.rid for c in chunks)
                    raise InjectedFault("the model run failed")
                return run(chunks)

            return faulty

        def alloc(real: Any) -> Any:
            from radixlang.runtime.block_pool import OutOfBlocksError

            def faulty(n: int) -> list[int]:
                if n and rng.random() < self.alloc_rate:
                    self.counts["alloc"] += 1
                    raise OutOfBlocksError(n, eng.pool.num_free, eng.pool.num_blocks)
                return real(n)

            return faulty

        def encode(real: Any) -> Any:
            def faulty(text: Any, *args: Any, **kwargs: Any) -> Any:
                if isinstance(text, str) and TOKENIZER_MARKER in text:
                    with lock:
                        self.counts["tokenizer"] += 1
                    raise InjectedFault("the tokenizer failed")
                return real(text, *args, **kwargs)

            return faulty

        patch(eng, "_run", forward)
        patch(eng.pool, "alloc", alloc)
        patch(eng.tokenizer, "encode", encode)
        self._patch_constraints(rng, lock)
        return self

    def _patch_constraints(self, rng: random.Random, lock: threading.Lock) -> None:
        from radixlang.constrain.grammar import GrammarConstraint

        real = GrammarConstraint.advance

        def advance(constraint: Any, token_id: int) -> None:
            marked = CONSTRAINT_FAULT_REGEX in constraint.grammar.source
            with lock:
                fail = marked or rng.random() < self.constraint_rate
                self.counts["constraint"] += fail
            if fail:
                raise InjectedFault("the constraint failed")
            real(constraint, token_id)

        GrammarConstraint.advance = advance  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(GrammarConstraint, "advance", real))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


# ---- the run -------------------------------------------------------------------------------
@dataclass
class Job:
    spec: Spec | None  # None: a light or malformed request (see LIGHT)
    # "complete", "disconnect", "abort", "tokenizer_fault", "forward_fault",
    # "constraint_fault", "light"
    action: str
    light: str = ""


LIGHT: dict[str, tuple[str, str, Any, tuple[int, ...]]] = {
    # name: (method, path, json body or None, statuses it may answer)
    "health": ("GET", "/health", None, (200,)),
    "metrics": ("GET", "/metrics", None, (200,)),
    "memory": ("GET", "/memory", None, (200,)),
    "model_info": ("GET", "/get_model_info", None, (200,)),
    "server_info": ("GET", "/server_info", None, (200,)),
    "models": ("GET", "/v1/models", None, (200,)),
    "tokenize": ("POST", "/tokenize", {"text": "How far is the moon?"}, (200,)),
    "detokenize": ("POST", "/detokenize", {"tokens": [1, 2, 3, 400]}, (200,)),
    "flush_busy": ("POST", "/flush_cache", None, (200, 400)),  # 400 while requests run
    "bad_json": ("POST", "/generate", "{not json", (400,)),
    "bad_field": (
        "POST",
        "/v1/completions",
        {"model": "default", "prompt": "x", "max_tokens": -1},
        (400,),
    ),
    "bad_regex": ("POST", "/generate", {"text": "x", "sampling_params": {"regex": "(a"}}, (400,)),
}


@dataclass
class Outcome:
    job: Job
    result: str  # "ok", "aborted", "disconnected", "faulted", "refused_ok", "lost"
    latency: float = 0.0
    tokens: int = 0
    detail: str = ""


def _plan(specs: Sequence[Spec], n: int, rng: random.Random, disconnect: float) -> list[Job]:
    jobs = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.08:
            jobs.append(Job(None, "light", rng.choice(list(LIGHT))))
            continue
        spec = rng.choice(specs)
        if roll < 0.11:
            jobs.append(Job(spec, "tokenizer_fault"))
        elif roll < 0.11 + disconnect:
            jobs.append(Job(spec, "disconnect"))
        elif roll < 0.16 + disconnect and spec.kind in ("native", "native_stream"):
            jobs.append(Job(spec, "abort"))
        else:
            jobs.append(Job(spec, "complete"))
    # Marked requests, spread over the run: a failed model run and a failed constraint each,
    # per MARKED_EVERY requests (at least one), on native requests (a model run knows a request
    # by its id, which only SGLang's native API lets a client give).
    marked = max(1, n // MARKED_EVERY)
    native = [s for s in specs if s.kind in ("native", "native_stream")]
    regex = [s for s in specs if s.kind == "native_regex"]
    for j in range(2 * marked):
        kind, pool = ("forward_fault", native) if j % 2 == 0 else ("constraint_fault", regex)
        jobs[(j + 1) * n // (2 * marked + 1)] = Job(rng.choice(pool), kind)
    return jobs


def _tokenizer_fault_body(spec: Spec) -> dict[str, Any]:
    body = json.loads(json.dumps(spec.body))
    if "messages" in body:
        body["messages"][-1]["content"] += TOKENIZER_MARKER
    elif "prompt" in body:
        body["prompt"] += TOKENIZER_MARKER
    elif isinstance(body["text"], list):
        body["text"][0] += TOKENIZER_MARKER
    else:
        body["text"] += TOKENIZER_MARKER
    return body


async def _run_job(client: httpx.AsyncClient, job: Job, rng: random.Random, n: int) -> Outcome:
    started = time.perf_counter()
    if job.spec is None:
        method, path, body, statuses = LIGHT[job.light]
        kwargs: dict[str, Any] = {}
        if isinstance(body, str):
            kwargs = {"content": body, "headers": {"content-type": "application/json"}}
        elif body is not None:
            kwargs = {"json": body}
        response = await client.request(method, path, **kwargs)
        ok = response.status_code in statuses
        return Outcome(job, "refused_ok" if ok else "lost", detail=f"{path} {response.status_code}")
    spec = job.spec
    if job.action == "disconnect":
        try:
            answer = await asyncio.wait_for(send(client, spec), rng.uniform(0.0, 0.6))
        except TimeoutError:
            return Outcome(job, "disconnected")
    elif job.action == "abort":
        rid = f"soak-{n}"
        body = {**spec.body, "rid": rid}
        task = asyncio.ensure_future(send(client, spec, body))
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        await client.post("/abort_request", json={"rid": rid})
        answer = await task
        if answer.status == 200 and answer.error is None and answer.finish == "abort":
            ok = spec.reference is not None and spec.reference.startswith(answer.text)
            return Outcome(job, "aborted" if ok else "lost", detail=answer.text[:80])
    elif job.action == "tokenizer_fault":
        answer = await send(client, spec, _tokenizer_fault_body(spec))
        ok = answer.status == 500 and FAULT in (answer.error or "")
        return Outcome(job, "faulted" if ok else "lost", detail=f"{answer.status} {answer.error}")
    elif job.action in ("forward_fault", "constraint_fault"):
        body = json.loads(json.dumps(spec.body))
        if job.action == "forward_fault":
            body["rid"] = f"{FORWARD_FAULT_RID}{n}"
        else:
            body["sampling_params"]["regex"] = CONSTRAINT_FAULT_REGEX
        answer = await send(client, spec, body)
        ok = answer.status in (200, 500) and FAULT in (answer.error or "")
        return Outcome(job, "faulted" if ok else "lost", detail=f"{answer.status} {answer.error}")
    else:
        answer = await send(client, spec)
    latency = time.perf_counter() - started
    if answer.error is not None:
        faulted = FAULT in answer.error and answer.status in (200, 500)
        return Outcome(job, "faulted" if faulted else "lost", latency,
                       detail=f"{answer.status} {answer.error}")  # fmt: skip
    if answer.status == 200 and answer.text == spec.reference:
        return Outcome(job, "ok", latency, answer.tokens)
    return Outcome(job, "lost", latency, detail=f"{answer.status} {answer.text[:60]!r} "
                   f"!= {str(spec.reference)[:60]!r}")  # fmt: skip


async def _clients(url: str, jobs: list[Job], clients: int, seed: int) -> list[Outcome]:
    queue: asyncio.Queue[tuple[int, Job]] = asyncio.Queue()
    for i, job in enumerate(jobs):
        queue.put_nowait((i, job))
    outcomes: list[Outcome] = []

    async def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while not queue.empty():
                i, job = queue.get_nowait()
                try:
                    outcomes.append(await _run_job(http, job, rng, i))
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    outcomes.append(Outcome(job, "lost", detail=f"{type(e).__name__}: {e}"))

    await asyncio.gather(*(client(c) for c in range(clients)))
    return outcomes


async def _slow_stream(url: str, held: asyncio.Event, stop: asyncio.Event, i: int) -> int:
    """A client that starts a long stream, reads its first event and then reads nothing more
    until ``stop``: the bytes of the rest wait in the server's and the kernel's buffers."""
    body = {"text": f"A very long story, number {i}:", "stream": True,
            "sampling_params": {"max_new_tokens": SLOW_TOKENS, "ignore_eos": True,
                                "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 5}  # fmt: skip
    async with (
        httpx.AsyncClient(base_url=url, timeout=600) as http,
        http.stream("POST", "/generate", json=body) as response,
    ):
        lines = response.aiter_lines()
        await anext(lines)
        held.set()
        await stop.wait()
        return response.status_code


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _wait_idle(engine: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while engine._call(engine.scheduler.has_work) or engine.num_waiting:
        if time.monotonic() > deadline:
            raise AssertionError("the engine did not go idle")
        time.sleep(0.05)


def _references(model: Path, specs: list[Spec]) -> int:
    """Each spec alone on a roomy server; returns the blocks the cache then holds."""
    from radixlang.runtime import Engine
    from radixlang.server.app import serve_in_thread

    engine = Engine(str(model), num_blocks=20_000, block_size=BLOCK_SIZE, dtype="float32")
    try:
        with serve_in_thread(engine) as server:

            async def run() -> None:
                async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                    for spec in specs:
                        answer = await send(http, spec)
                        if answer.status != 200 or answer.error is not None:
                            raise AssertionError(f"reference {spec.kind}: {answer}")
                        spec.reference = answer.text

            asyncio.run(run())
            _wait_idle(engine)
            stats = engine.stats()
            assert stats["evicted_blocks"] == 0, "the reference pool was too small"
            return int(stats["blocks_used"])
    finally:
        engine.shutdown(free_cache=True)


def run_soak(
    model: Path,
    requests: int = 2000,
    clients: int = 100,
    specs: int = 160,
    pool_fraction: float = 0.25,
    disconnect: float = 0.2,
    slow_clients: int = 4,
    seed: int = 0,
    faults: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The whole soak (see the module docstring); raises ``AssertionError`` when a check
    fails, else returns the figures."""
    from radixlang.runtime import Engine
    from radixlang.server.app import serve_in_thread

    all_specs = make_specs(specs, seed)
    working_set = _references(model, all_specs)
    # At least two of the longest requests' worth (a slow client's stream): below that a
    # request outgrows the whole pool and is cut short by design.
    num_blocks = max(int(working_set * pool_fraction), 2 * -(-(SLOW_TOKENS + 64) // BLOCK_SIZE))
    engine = Engine(str(model), num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype="float32")
    rng = random.Random(seed)
    jobs = _plan(all_specs, requests, rng, disconnect)
    injector = FaultInjector(engine, seed=seed, **(faults or {}))
    rss_before = _rss_mib()
    try:
        with serve_in_thread(engine) as server:
            injector.install()
            started = time.perf_counter()

            async def soak() -> tuple[list[Outcome], bool, list[int]]:
                held, stop = asyncio.Event(), asyncio.Event()
                slow = [asyncio.ensure_future(_slow_stream(server.url, held, stop, i))
                        for i in range(slow_clients)]  # fmt: skip
                if slow:
                    await asyncio.wait_for(held.wait(), 60)
                outcomes = await _clients(server.url, jobs, clients, seed)
                # The slow clients still read nothing: the engine must be done with them.
                idle = await asyncio.to_thread(_idle_within, engine, 120.0)
                stop.set()
                statuses = list(await asyncio.gather(*slow))
                return outcomes, idle, statuses

            outcomes, idle_while_held, slow_statuses = asyncio.run(soak())
            wall = time.perf_counter() - started
            injector.remove()
            rss_after = _rss_mib()
            _wait_idle(engine)
            engine.check_integrity()
            stats = engine.stats()
            held_blocks = int(stats["blocks_used"] - stats["blocks_evictable"])
            flushed = engine.flush_cache(5.0)
            free_after = engine.pool.num_free
    finally:
        injector.remove()
        engine.shutdown(free_cache=True)
    return _report(
        outcomes, injector, wall, working_set, num_blocks, idle_while_held, slow_statuses,
        held_blocks, flushed, free_after, stats, rss_before, rss_after, requests, clients,
    )  # fmt: skip


def _idle_within(engine: Any, timeout: float) -> bool:
    try:
        _wait_idle(engine, timeout)
        return True
    except AssertionError:
        return False


def _report(outcomes: list[Outcome], injector: FaultInjector, wall: float, working_set: int,
            num_blocks: int, idle_while_held: bool, slow_statuses: list[int], held_blocks: int,
            flushed: bool, free_after: int, stats: dict[str, Any], rss_before: float,
            rss_after: float, requests: int, clients: int) -> dict[str, Any]:  # fmt: skip
    by_result = Counter(o.result for o in outcomes)
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        kind = o.job.spec.kind if o.job.spec else f"light:{o.job.light}"
        by_kind.setdefault(kind, Counter())[o.result] += 1
    ok = [o for o in outcomes if o.result == "ok"]
    latencies = [o.latency for o in ok]
    faulted_model_runs = sum(
        1 for o in outcomes if o.result == "faulted" and "model run" in o.detail
    )
    return {
        "requests": requests,
        "clients": clients,
        "answered": len(outcomes),
        "planned": dict(Counter(o.job.action for o in outcomes)),
        "outcomes": dict(by_result),
        "outcomes_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "lost": [
            f"{o.job.spec.kind if o.job.spec else o.job.light}: {o.detail}"
            for o in outcomes
            if o.result == "lost"
        ][:20],
        "faults_injected": dict(injector.counts),
        "model_runs": injector.model_runs,
        "requests_in_failed_model_runs": len(injector.failed_rids),
        "answers_naming_a_failed_model_run": faulted_model_runs,
        "working_set_blocks": working_set,
        "pool_blocks": num_blocks,
        "pool_fraction": round(num_blocks / working_set, 3),
        "wall_s": round(wall, 2),
        "completed_per_s": round(len(ok) / wall, 2),
        "output_tokens_per_s": round(sum(o.tokens for o in ok) / wall, 1),
        "latency_p50_s": round(percentile(latencies, 50), 3) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 99), 3) if latencies else None,
        "slow_clients": len(slow_statuses),
        "engine_idle_while_slow_clients_held_their_streams": idle_while_held,
        "held_blocks_after": held_blocks,
        "flushed_after": flushed,
        "free_blocks_after_flush": free_after,
        "rss_mib_before": round(rss_before, 1),
        "rss_mib_after": round(rss_after, 1),
        "retractions": stats.get("retractions"),
        "evicted_blocks": stats["evicted_blocks"],
        "finished_error": stats.get("finished_error"),
    }


def check(result: dict[str, Any]) -> None:
    """The soak's promises; raises AssertionError naming the first one broken."""
    out = result["outcomes"]
    assert result["answered"] == result["requests"], "a request got no outcome"
    assert out.get("lost", 0) == 0, f"lost requests: {result['lost']}"
    # Every request sent to complete answered as alone, unless a fault hit it: a failed model
    # run (every request of such a run fails, and how many shared it depends on the batching,
    # so the bound counts them all) or a constraint's. (Dropped and aborted ones may end ok too.)
    hit = result["requests_in_failed_model_runs"] + result["faults_injected"].get("constraint", 0)
    assert out.get("ok", 0) > 0, out
    assert out["ok"] >= result["planned"].get("complete", 0) - hit, (out, result["planned"])
    assert result["held_blocks_after"] == 0, "a request still holds blocks"
    assert result["flushed_after"] and result["free_blocks_after_flush"] == result["pool_blocks"]
    assert result["engine_idle_while_slow_clients_held_their_streams"]
    missing = {"forward", "alloc", "tokenizer", "constraint"} - set(result["faults_injected"])
    assert not missing, f"no {', '.join(sorted(missing))} fault was injected: nothing was tested"
    # Each answer that names a failed model run was one of that run's requests.
    assert result["answers_naming_a_failed_model_run"] <= result["requests_in_failed_model_runs"]


# ---- output --------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests from {result['clients']} clients in "
             f"{result['wall_s']} s; pool {result['pool_blocks']} blocks = "
             f"{result['pool_fraction']:.0%} of the working set ({result['working_set_blocks']})",
             f"outcomes: {result['outcomes']}", f"faults injected: {result['faults_injected']}",
             f"completed: {result['completed_per_s']} req/s, {result['output_tokens_per_s']} "
             f"output tok/s, latency p50 {result['latency_p50_s']} s, p99 "
             f"{result['latency_p99_s']} s",
             f"after: {result['held_blocks_after']} held blocks, flush freed all: "
             f"{result['free_blocks_after_flush'] == result['pool_blocks']}, RSS "
             f"{result['rss_mib_before']} -> {result['rss_mib_after']} MiB"]  # fmt: skip
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    outcomes = result["outcomes"]
    left.bar(list(outcomes), list(outcomes.values()), color="tab:blue")
    left.set_title(f"{result['requests']} requests, {result['clients']} clients: outcomes")
    left.tick_params(axis="x", rotation=30)
    faults = result["faults_injected"]
    right.bar(list(faults), list(faults.values()), color="tab:red")
    right.set_title(
        f"faults injected; p50 {result['latency_p50_s']} s, p99 {result['latency_p99_s']} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--specs", type=int, default=160)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--disconnect", type=float, default=0.2)
    parser.add_argument("--slow-clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="300 requests, 30 clients")
    parser.add_argument("--model", type=Path, help="a model folder (default: a tiny random "
                        "chat model written for the run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_soak.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.specs, args.slow_clients = 300, 30, 48, 2
    from radixlang.testing import write_tiny_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_chat_model(Path(tmp) / "tiny")
        result = run_soak(model, args.requests, args.clients, args.specs, args.pool_fraction,
                          args.disconnect, args.slow_clients, args.seed)  # fmt: skip
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    result["command"] = "python benchmarks/bench_soak.py " + " ".join(argv or sys.argv[1:])
    result["provenance"] = provenance(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(table(result))
    check(result)
    return result


if __name__ == "__main__":
    main()
