"""The HTTP server against the in-process engine, at 1, 8 and 32 concurrent clients.

One command:  .venv/bin/python benchmarks/bench_server.py [--quick]
Writes benchmarks/results/bench_server.json and .png.

``radixlang serve`` runs as a subprocess on a free loopback port. At each concurrency level C,
C clients (one ``httpx.AsyncClient`` each) send a level's requests one after another, each
taking the next prompt when its last request is done: ``POST /generate`` with ``"stream": true``
(so the time to the first token is measurable), greedy, ``max_new_tokens`` tokens with EOS
ignored, so that every request generates the same number of tokens. The prompts are distinct: a
shared ~100-token system-like preamble then a distinct question (``--no-shared-prefix`` puts the
question first, so no two prompts share a prefix while the amount of text stays the same).
Before each level the cache is flushed and a short warm-up runs, which also caches the shared
preamble, as a server that has been up a while holds it.

Per level: wall time, output tokens/s and requests/s, end-to-end latency and time to first
token (p50/p99, measured by the client), and the deltas of the server's /metrics counters
(prompt tokens computed vs reused from the cache, steps, retractions, evictions).

The baseline runs the same requests with the same concurrency on an in-process ``Engine`` (same
model, dtype and KV memory; C asyncio tasks, each ``submit`` then stream the handle), after the
server has stopped, so that the two never share the CPU. ``http_overhead`` = server wall time /
engine wall time at the same level is the figure to read: the machines are shared and noisy.
On a CPU machine the clients (this process) take CPU time from the server, so the overhead
includes the cost of the client too, as it does for any client on the same host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from provenance import provenance
from tqdm import tqdm

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime import Engine
from radixlang.server import metrics

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

PREAMBLE = (
    "You are a patient tutor at a public library's homework help desk. Students of every age "
    "ask you about science, history, mathematics, music and the natural world. Answer in plain "
    "words, with one concrete example when it helps, and keep each answer short: a few "
    "sentences at most. If a question is unclear, say what you understood and answer that. If "
    "you do not know something, say so honestly and suggest a book or a librarian who could "
    "help. Never make up dates, numbers or quotations."
)
TOPICS = ("the water cycle", "photosynthesis", "the French Revolution", "black holes",
          "compound interest", "plate tectonics", "the immune system", "binary numbers",
          "the Roman Empire", "ocean tides", "volcanoes", "the printing press",
          "electric circuits", "honeybees", "the Silk Road", "prime numbers", "glaciers",
          "the human heart", "jazz music", "rainbows")  # fmt: skip
TEMPLATES = ("Explain {} to a ten-year-old.", "What are three surprising facts about {}?",
             "Which books would you recommend to learn about {}?",
             "Write a short quiz question about {}.", "Why does {} matter today?",
             "Summarize {} in two sentences.")  # fmt: skip

# /metrics counters whose deltas each level reports, by the engine.stats() key they come from.
COUNTERS = {
    "prompt_tokens": "prompt_tokens_total",
    "prompt_tokens_computed": "prompt_tokens_computed_total",
    "prompt_tokens_reused": "prompt_tokens_cached_total",
    "generated_tokens": "generated_tokens_total",
    "finished_requests": "requests_finished_total",
    "steps": "engine_steps_total",
    "retractions": "retractions_total",
    "evicted_blocks": "evicted_blocks_total",
}
# Gauges read after each level: anything still running or held there is a leak.
GAUGES = {"running_requests": "requests_running", "blocks_used": "kv_blocks_used",
          "blocks_evictable": "kv_blocks_evictable"}  # fmt: skip


# ---- the workload ----------------------------------------------------------------------------
def question(i: int, tag: str = "Question") -> str:
    template = TEMPLATES[i % len(TEMPLATES)]
    return f"{tag} {i + 1}: " + template.format(TOPICS[(i // len(TEMPLATES)) % len(TOPICS)])


def make_prompts(n: int, shared_prefix: bool, tag: str = "Question") -> list[str]:
    if shared_prefix:
        return [f"{PREAMBLE}\n\n{question(i, tag)}\nAnswer:" for i in range(n)]
    # The question first: prompts differ from their first tokens, with the same amount of text.
    return [f"{question(i, tag)}\n\n{PREAMBLE}\nAnswer:" for i in range(n)]


@dataclass
class Sample:
    """One request as its client saw it."""

    ttft: float  # seconds from sending to the first token
    latency: float  # seconds from sending to the end of the answer
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    text: str
    engine_latency: float | None = None  # the server's own e2e_latency (from meta_info)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Side(Protocol):
    """What a level runs against: the HTTP server or the in-process engine."""

    name: str

    def open_client(self) -> Any: ...
    async def close_client(self, client: Any) -> None: ...
    async def request(self, client: Any, prompt: str, params: dict[str, Any]) -> Sample: ...
    async def flush(self) -> None: ...
    async def read(self) -> dict[str, float]: ...  # COUNTERS and GAUGES by stats key


class ServerSide:
    name = "server"

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self.control = self.open_client()

    def open_client(self) -> httpx.AsyncClient:
        # trust_env=False: a proxy set in the environment must not see loopback traffic.
        return httpx.AsyncClient(base_url=self.url, timeout=self.timeout, trust_env=False)

    async def close_client(self, client: httpx.AsyncClient) -> None:
        await client.aclose()

    async def request(
        self, client: httpx.AsyncClient, prompt: str, params: dict[str, Any]
    ) -> Sample:
        body = {"text": prompt, "sampling_params": params, "stream": True}
        start = time.perf_counter()
        ttft: float | None = None
        final: dict[str, Any] | None = None
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"/generate answered {response.status_code}: {response.text}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                if ttft is None:
                    ttft = time.perf_counter() - start
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"/generate streamed an error: {chunk['error']}")
                if "prompt_tokens" in chunk.get("meta_info", {}):  # the result, last
                    final = chunk
        latency = time.perf_counter() - start
        if final is None or ttft is None:
            raise RuntimeError(f"/generate's stream ended without a result: {final}")
        meta = final["meta_info"]
        return Sample(
            ttft=ttft,
            latency=latency,
            completion_tokens=meta["completion_tokens"],
            prompt_tokens=meta["prompt_tokens"],
            cached_tokens=meta["cached_tokens"],
            finish_reason=meta["finish_reason"]["type"],
            text=final["text"],
            engine_latency=meta["e2e_latency"],
        )

    async def flush(self) -> None:
        response = await self.control.post("/flush_cache")
        if response.status_code != 200:
            raise RuntimeError(f"/flush_cache answered {response.status_code}: {response.text}")

    async def read(self) -> dict[str, float]:
        response = await self.control.get("/metrics")
        response.raise_for_status()
        samples = metrics.parse(response.text)
        names = COUNTERS | GAUGES
        return {key: samples[metrics.PREFIX + name] for key, name in names.items()}

    async def get_json(self, path: str) -> Any:
        response = await self.control.get(path)
        response.raise_for_status()
        return response.json()


class EngineSide:
    name = "engine"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def open_client(self) -> None:
        return None

    async def close_client(self, client: None) -> None:
        return None

    async def request(self, client: None, prompt: str, params: dict[str, Any]) -> Sample:
        start = time.perf_counter()
        handle = self.engine.submit(prompt, dict(params))  # tokenizes here, as the server does
        ttft: float | None = None
        async for event in handle.stream():
            if ttft is None and event.token_ids:
                ttft = time.perf_counter() - start
        result = await handle.wait()
        latency = time.perf_counter() - start
        return Sample(
            ttft=latency if ttft is None else ttft,
            latency=latency,
            completion_tokens=result.completion_tokens,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            finish_reason=result.finish_reason.value,
            text=result.text,
            engine_latency=result.latency,
        )

    async def flush(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("the engine refused to flush its cache: requests in flight")

    async def read(self) -> dict[str, float]:
        stats = self.engine.stats()  # between levels: nothing else waits on the event loop
        return {key: float(stats[key]) for key in [*COUNTERS, *GAUGES]}


@dataclass
class Level:
    concurrency: int
    requests: int
    prompts: list[str]
    warmup: list[str]


async def run_clients(
    side: Side,
    clients: list[Any],
    prompts: list[str],
    params: dict[str, Any],
    progress: tqdm | None = None,
) -> list[Sample]:
    """Each client sends requests one after another, taking the next prompt when free."""
    samples: list[Sample | None] = [None] * len(prompts)
    indices = iter(range(len(prompts)))  # shared: the tasks run on one event loop

    async def client_loop(client: Any) -> None:
        for i in indices:
            samples[i] = await side.request(client, prompts[i], params)
            if progress is not None:
                progress.update()

    await asyncio.gather(*(client_loop(c) for c in clients))
    return [s for s in samples if s is not None]


def figures(
    samples: list[Sample], wall: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    latency = [s.latency for s in samples]
    ttft = [s.ttft for s in samples]
    tokens = sum(s.completion_tokens for s in samples)
    engine_latency = [s.engine_latency for s in samples if s.engine_latency is not None]
    return {
        "requests": len(samples),
        "generated_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(samples) / wall,
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "latency_mean_s": sum(latency) / len(latency),
        "latency_max_s": max(latency),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft),
        # The engine's own submission-to-finish time: latency minus this is the transport's.
        "engine_latency_p50_s": percentile(engine_latency, 50) if engine_latency else None,
        "engine_latency_max_s": max(engine_latency) if engine_latency else None,
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "cached_tokens_reported": sum(s.cached_tokens for s in samples),
        "finish_reasons": {
            r: sum(s.finish_reason == r for s in samples)
            for r in sorted({s.finish_reason for s in samples})
        },
        "counters": {k: after[k] - before[k] for k in COUNTERS},
        "after": {k: after[k] for k in GAUGES},
        "loadavg_1min": os.getloadavg()[0],
        # Per request, in prompt order: where a spike sits (first request, a whole wave...).
        "latency_s": [round(x, 4) for x in latency],
        "ttft_s": [round(x, 4) for x in ttft],
    }


async def run_levels(
    side: Side, levels: list[Level], args: argparse.Namespace, label: str | None = None
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    warm_params = {**params, "max_new_tokens": min(8, args.max_new_tokens)}
    results, texts = [], []
    for level in levels:
        clients = [side.open_client() for _ in range(level.concurrency)]  # outside the timing
        try:
            await side.flush()
            # Warms the connections and caches the shared preamble, as on a server up a while.
            await run_clients(side, clients[: len(level.warmup)], level.warmup, warm_params)
            before = await side.read()
            desc = f"  {label or side.name} c={level.concurrency}"
            bar = tqdm(total=len(level.prompts), desc=desc, unit="req", file=sys.stderr,
                       leave=False, disable=None)  # fmt: skip
            start = time.perf_counter()
            with bar:
                samples = await run_clients(side, clients, level.prompts, params, bar)
            wall = time.perf_counter() - start
            after = await side.read()
        finally:
            for client in clients:
                await side.close_client(client)
        entry = figures(samples, wall, before, after)
        results.append(entry)
        texts.append([s.text for s in samples])
        print(
            f"  {label or side.name} c={level.concurrency:<3d} {entry['requests']:4d} requests "
            f"{wall:7.2f} s  {entry['output_tokens_per_s']:7.1f} tok/s  "
            f"p50 {entry['latency_p50_s']:.3f} s  ttft p50 {entry['ttft_p50_s']:.3f} s",
            flush=True,
        )
    return results, texts


# ---- the server process ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``radixlang serve`` in a subprocess, its output in files (a full pipe would stall it)."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.command = [
            sys.executable, "-m", "radixlang.cli", "serve", "--model", str(args.model),
            "--host", HOST, "--port", str(self.port), "--dtype", args.dtype,
            "--device", args.device, "--kv-memory", args.kv_memory, "--log-level", "warning",
        ]  # fmt: skip
        self.stdout_path, self.stderr_path = log_dir / "server.out", log_dir / "server.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=err, cwd=REPO)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} before answering /health:\n"
                    f"{self.stderr()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"the server did not answer /health within {timeout:.0f} s:\n{self.stderr()[-4000:]}"
        )

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (the server drains and frees every block), then wait; kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_server(
    args: argparse.Namespace, levels: list[Level]
) -> tuple[dict[str, Any], list[dict[str, Any]], list[list[str]]]:
    with tempfile.TemporaryDirectory(prefix="bench_server_") as log_dir:
        server = ServerProcess(args, Path(log_dir))
        info: dict[str, Any] = {"command": server.command[1:]}  # without the interpreter's path
        try:
            info["startup_s"] = server.wait_healthy(args.startup_timeout)
            print(f"server up on {server.url} after {info['startup_s']:.1f} s", flush=True)

            async def run() -> tuple[list[dict[str, Any]], list[list[str]]]:
                side = ServerSide(server.url, args.request_timeout)
                try:
                    info["server_info"] = await side.get_json("/get_server_info")
                    results, texts = await run_levels(side, levels, args)
                    if args.dashboard:
                        info["dashboard"] = await run_dashboard_rounds(side, levels, args, results)
                        if args.dashboard_windows:
                            windows = await run_dashboard_windows(side, args)
                            info["dashboard"]["windows"] = windows
                    await side.flush()
                    info["before_stop"] = await side.read()
                    return results, texts
                finally:
                    await side.close_client(side.control)

            results, texts = asyncio.run(run())
        finally:
            started = time.perf_counter()
            code = server.stop()
            info["stop_s"] = time.perf_counter() - started
            info["exit_code"] = code
            stderr = server.stderr()
            info["stdout"] = server.stdout()[-2000:]
            info["stderr_tail"] = stderr[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith(("ERROR", "CRITICAL"))]
    info["stderr_error_lines"] = errors
    # A failure in the shutdown (a block still held, say) is logged at ERROR.
    info["clean_shutdown"] = code == 0 and not errors
    print(f"server stopped with exit code {code} in {info['stop_s']:.1f} s", flush=True)
    return info, results, texts


# ---- the dashboard's cost ------------------------------------------------------------------
class DashboardWatcher:
    """What an open dashboard page asks of the server: the history and the programs once, then
    the live event stream (the programs again whenever their version changes)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0
        self.bytes = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=None, trust_env=False) as client:
            for path in ("/dashboard/api/history", "/dashboard/api/programs"):
                (await client.get(path)).raise_for_status()
            version = None
            async with client.stream("GET", "/dashboard/api/events") as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    snapshot = json.loads(line[5:])
                    self.events += 1
                    self.bytes += len(line)
                    if snapshot["programs_version"] != version:
                        version = snapshot["programs_version"]
                        (await client.get("/dashboard/api/programs")).raise_for_status()


async def run_dashboard_rounds(
    side: ServerSide, levels: list[Level], args: argparse.Namespace, first: list[dict[str, Any]]
) -> dict[str, Any]:
    """The levels again on the same server, with a dashboard watching (open) and without
    (closed), in pairs whose order alternates (open-closed, closed-open, ...) so that a drift of
    the machine's speed falls on both sides; ``first`` is the closed run already made."""
    if args.dashboard_rounds == 0:
        return {"rounds": 0, "watched": [], "levels": []}
    closed, opened, pairs, watched = [first], [], [], []
    for round_ in range(args.dashboard_rounds):
        pair: dict[str, list[dict[str, Any]]] = {}
        for state in ("open", "closed") if round_ % 2 == 0 else ("closed", "open"):
            if state == "closed":
                pair[state] = (await run_levels(side, levels, args))[0]
                continue
            watcher = DashboardWatcher(side.url)
            task = asyncio.create_task(watcher.run())
            try:
                pair[state] = (await run_levels(side, levels, args, "server+dashboard"))[0]
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if watcher.events == 0:
                raise RuntimeError("the dashboard's event stream sent nothing during a whole run")
            watched.append({"events": watcher.events, "bytes": watcher.bytes})
        opened.append(pair["open"])
        closed.append(pair["closed"])
        pairs.append(pair)
    out = []
    for i, level in enumerate(levels):
        shut = [run[i]["output_tokens_per_s"] for run in closed]
        live = [run[i]["output_tokens_per_s"] for run in opened]
        per_pair = [p["open"][i]["output_tokens_per_s"] / p["closed"][i]["output_tokens_per_s"]
                    for p in pairs]  # fmt: skip
        out.append({
            "concurrency": level.concurrency,
            "closed_tokens_per_s": shut,
            "open_tokens_per_s": live,
            "pair_ratios": per_pair,
            "median_pair_ratio": statistics.median(per_pair),
            "ratio_of_medians": statistics.median(live) / statistics.median(shut),
            "ratio_min": min(live) / max(shut),
            "ratio_max": max(live) / min(shut),
        })  # fmt: skip
    return {"rounds": args.dashboard_rounds, "watched": watched, "levels": out}


async def run_dashboard_windows(side: ServerSide, args: argparse.Namespace) -> dict[str, Any]:
    """One continuous load at the highest concurrency, the dashboard opened and closed in
    windows of ``--dashboard-window`` seconds in the order open, closed, closed, open, ... (so
    that a drift of the machine's speed falls on both sides), generated tokens per second read
    from /metrics at each window's edges. Short windows over one load resolve a small cost
    better than whole runs on a shared machine whose speed wanders by 10% from run to run."""
    concurrency = max(args.concurrency)
    prompts = make_prompts(4096, args.shared_prefix, tag="Window question")
    clients = [side.open_client() for _ in range(concurrency)]
    stop = asyncio.Event()
    # Lengths from half to one and a half max_new_tokens, so the clients' requests fall out of
    # step: in lockstep they end together, and a window's count swings with where it falls in
    # that wave rather than with the dashboard.
    low = max(1, args.max_new_tokens // 2)

    async def client_loop(client: Any, first: int) -> None:
        i = first
        while not stop.is_set():
            length = low + (i * 37) % (args.max_new_tokens + 1)
            params = {"temperature": 0, "max_new_tokens": length, "ignore_eos": True}
            await side.request(client, prompts[i % len(prompts)], params)
            i += concurrency

    loops = [asyncio.create_task(client_loop(c, k)) for k, c in enumerate(clients)]
    windows: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(args.dashboard_window)  # to a steady state first
        for w in range(args.dashboard_windows):
            is_open = (w % 4) in (0, 3)
            watcher = DashboardWatcher(side.url)
            task = asyncio.create_task(watcher.run()) if is_open else None
            before, start = await side.read(), time.perf_counter()
            await asyncio.sleep(args.dashboard_window)
            after, end = await side.read(), time.perf_counter()
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            tokens = after["generated_tokens"] - before["generated_tokens"]
            rate = tokens / (end - start)
            windows.append({"open": is_open, "seconds": end - start, "tokens": tokens,
                            "tokens_per_s": rate, "events": watcher.events})  # fmt: skip
            print(f"  window {w + 1:2d} {'open  ' if is_open else 'closed'} "
                  f"{rate:7.1f} tok/s", flush=True)  # fmt: skip
    finally:
        stop.set()
        await asyncio.gather(*loops)
        for client in clients:
            await side.close_client(client)
    live = [w["tokens_per_s"] for w in windows if w["open"]]
    shut = [w["tokens_per_s"] for w in windows if not w["open"]]
    # Each open window against the closed one beside it (o c | c o | o c | ...).
    pairs = [windows[i]["tokens_per_s"] / windows[i + 1]["tokens_per_s"]
             if windows[i]["open"] else windows[i + 1]["tokens_per_s"] / windows[i]["tokens_per_s"]
             for i in range(0, len(windows) - 1, 2)]  # fmt: skip
    ratio = statistics.mean(live) / statistics.mean(shut)
    return {
        "concurrency": concurrency,
        "window_s": args.dashboard_window,
        "windows": windows,
        "ratio_of_means": ratio,
        "pair_ratios": pairs,
        "median_pair_ratio": statistics.median(pairs),
        # The spread of the pairs' ratios, as a standard error of their mean.
        "pair_ratio_stderr": statistics.stdev(pairs) / len(pairs) ** 0.5
        if len(pairs) > 1
        else None,
    }


def run_engine(
    args: argparse.Namespace, levels: list[Level]
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    engine = Engine(args.model, kv_memory=args.kv_memory, dtype=args.dtype, device=args.device)
    try:
        results, texts = asyncio.run(run_levels(EngineSide(engine), levels, args))
        engine.check_integrity()
    finally:
        engine.shutdown(free_cache=True)  # raises if a block is still held
    return results, texts


# ---- report --------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    head = (
        f"{'conc':>4}  {'side':6}  {'reqs':>4}  {'tokens':>6}  {'wall s':>7}  {'tok/s':>7}  "
        f"{'req/s':>6}  {'lat p50':>7}  {'lat p99':>7}  {'ttft p50':>8}  {'ttft p99':>8}  "
        f"{'computed':>8}  {'reused':>7}  {'overhead':>8}"
    )
    lines = [head, "-" * len(head)]
    for level in result["levels"]:
        for side in ("server", "engine"):
            f = level[side]
            overhead = f"{level['ratios']['http_overhead']:.3f}x" if side == "server" else ""
            lines.append(
                f"{level['concurrency']:>4}  {side:6}  {f['requests']:>4}  "
                f"{f['generated_tokens']:>6}  {f['wall_s']:>7.2f}  "
                f"{f['output_tokens_per_s']:>7.1f}  {f['requests_per_s']:>6.2f}  "
                f"{f['latency_p50_s']:>7.3f}  {f['latency_p99_s']:>7.3f}  "
                f"{f['ttft_p50_s']:>8.3f}  {f['ttft_p99_s']:>8.3f}  "
                f"{f['counters']['prompt_tokens_computed']:>8.0f}  "
                f"{f['counters']['prompt_tokens_reused']:>7.0f}  {overhead:>8}"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cs = [level["concurrency"] for level in levels]
    dashboard = result["server"].get("dashboard")
    fig, all_axes = plt.subplots(1, 4 if dashboard else 3, figsize=(20 if dashboard else 15, 4.3))
    axes = all_axes[:3]
    sides = (("server", "HTTP server", "C0"), ("engine", "in-process engine", "C1"))
    for side, label, color in sides:
        tps = [level[side]["output_tokens_per_s"] for level in levels]
        axes[0].plot(cs, tps, "o-", color=color, label=label)
        for ax, key in ((axes[1], "latency"), (axes[2], "ttft")):
            p50 = [level[side][f"{key}_p50_s"] for level in levels]
            p99 = [level[side][f"{key}_p99_s"] for level in levels]
            ax.plot(cs, p50, "o-", color=color, label=f"{label} p50")
            ax.plot(cs, p99, "s--", color=color, label=f"{label} p99")
    for level in levels:  # the ratio to read, over each server point
        axes[0].annotate(
            f"x{level['ratios']['http_overhead']:.2f}",
            (level["concurrency"], level["server"]["output_tokens_per_s"]),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
        )
    titles = (
        "output tokens / s (label: server wall / engine wall)",
        "end-to-end latency per request, s",
        "time to first token, s",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1:]:
        ax.set_yscale("log")
    if dashboard:
        _plot_dashboard(all_axes[3], dashboard)
    cfg = result["config"]
    fig.suptitle(
        f"radixlang serve vs in-process Engine: {result['model']} {cfg['dtype']} on "
        f"{result['machine']['device']} ({result['machine']['cpu_count']} CPUs), "
        f"{cfg['max_new_tokens']} new tokens per request, shared prefix {cfg['shared_prefix']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_dashboard(ax: Any, dashboard: dict[str, Any]) -> None:
    """Each run's tokens/s with the dashboard closed and open, per level."""
    for i, lv in enumerate(dashboard["levels"]):
        for offset, key, color, label in ((-0.12, "closed", "C0", "closed"),
                                          (0.12, "open", "C3", "open")):  # fmt: skip
            values = lv[f"{key}_tokens_per_s"]
            ax.plot([i + offset] * len(values), values, "o", color=color, alpha=0.7,
                    label=label if i == 0 else None)  # fmt: skip
        top = max(lv["closed_tokens_per_s"] + lv["open_tokens_per_s"])
        ax.annotate(f"x{lv['ratio_of_medians']:.3f}", (i, top), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(dashboard["levels"])),
                  [f"c={lv['concurrency']}" for lv in dashboard["levels"]])  # fmt: skip
    ax.set_title("tokens / s per run, dashboard closed vs open\n(label: open / closed medians)",
                 fontsize=9)  # fmt: skip
    win = dashboard.get("windows")
    if win:
        ax.text(0.02, 0.02, f"{len(win['windows'])} windows of {win['window_s']:g} s in one load: "
                f"open / closed {win['ratio_of_means']:.3f}x", transform=ax.transAxes,
                fontsize=8)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: bfloat16 where the CPU or GPU computes it natively, else float32 (a CPU "
        "without AVX-512 BF16 or AMX emulates bfloat16 several times slower)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-memory", default="1GiB", help="KV cache size on both sides")
    parser.add_argument("--concurrency", type=int, nargs="+", help="default 1 8 32 (quick: 1 4)")
    parser.add_argument("--max-new-tokens", type=int, help="default 64 (quick: 8)")
    parser.add_argument(
        "--requests",
        type=int,
        help="requests per level (default max(16, 4 x C); quick max(4, 2 x C))",
    )
    parser.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prompts share a ~100-token preamble (--no-shared-prefix: none shared)",
    )
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="also run each level with the dashboard open (its event stream read), alternating "
        "with runs without it on the same server: the dashboard's cost",
    )
    parser.add_argument("--dashboard-rounds", type=int, default=3, help="open/closed pairs")
    parser.add_argument(
        "--dashboard-windows",
        type=int,
        default=0,
        help="with --dashboard, then this many windows of one continuous load, the dashboard "
        "open and closed in turn (an even number; 0: none)",
    )
    parser.add_argument("--dashboard-window", type=float, default=10.0, help="seconds each")
    parser.add_argument("--quick", action="store_true", help="tiny numbers, for the smoke test")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = [1, 4] if args.quick else [1, 8, 32]
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.quick else 64

    files = load_model_files(args.model)  # a wrong name fails here, before any server starts
    prefix_tokens = len(files.load_tokenizer()(PREAMBLE)["input_ids"])
    levels = []
    for c in args.concurrency:
        n = args.requests or (max(4, 2 * c) if args.quick else max(16, 4 * c))
        warmup = make_prompts(min(c, 4), args.shared_prefix, tag="Warm-up question")
        levels.append(Level(c, n, make_prompts(n, args.shared_prefix), warmup))

    load_before = os.getloadavg()
    print(f"radixlang serve ({files.name}, {args.dtype}, {args.device}):", flush=True)
    server_info, server_levels, server_texts = run_server(args, levels)
    load_between = os.getloadavg()
    print(f"in-process engine ({files.name}, {args.dtype}, {args.device}):", flush=True)
    engine_levels, engine_texts = run_engine(args, levels)

    result: dict[str, Any] = {
        "benchmark": "bench_server",
        "provenance": provenance(argv),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
            # 1/5/15-minute load averages: other jobs on a shared machine skew the timings.
            "loadavg_before": load_before,
            "loadavg_between": load_between,
            "loadavg_after": os.getloadavg(),
        },
        "model": files.name,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": {
            "preamble_tokens": prefix_tokens,
            "example_prompt": levels[0].prompts[0],
            "sampling": {
                "temperature": 0,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True,
            },
            "warmup_max_new_tokens": min(8, args.max_new_tokens),
        },
        "server": server_info,
        "levels": [],
    }
    for i, level in enumerate(levels):
        srv, eng = server_levels[i], engine_levels[i]
        same = sum(a == b for a, b in zip(server_texts[i], engine_texts[i], strict=True))
        result["levels"].append(
            {
                "concurrency": level.concurrency,
                "requests": level.requests,
                "server": srv,
                "engine": eng,
                "ratios": {
                    "http_overhead": srv["wall_s"] / eng["wall_s"],
                    "latency_p50": srv["latency_p50_s"] / eng["latency_p50_s"],
                    "latency_p99": srv["latency_p99_s"] / eng["latency_p99_s"],
                    "ttft_p50": srv["ttft_p50_s"] / eng["ttft_p50_s"],
                },
                # Greedy on the same weights; in bfloat16 a different batch mix can flip a token.
                "identical_texts": same,
            }
        )
    result["summary"] = {
        "http_overhead": {
            str(lv["concurrency"]): lv["ratios"]["http_overhead"] for lv in result["levels"]
        },
        "server_exit_code": server_info["exit_code"],
        "server_clean_shutdown": server_info["clean_shutdown"],
    }
    dashboard = server_info.get("dashboard")
    if dashboard is not None:
        result["summary"]["dashboard_ratio"] = {
            str(lv["concurrency"]): lv["ratio_of_medians"] for lv in dashboard["levels"]
        }
    args.out.mkdir(parents=True, exist_ok=True)
    # A dashboard run is its own result: it must not replace the plain run's.
    name = "bench_server_dashboard" if args.dashboard else "bench_server"
    json_path, png_path = args.out / f"{name}.json", args.out / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    plot(result, png_path)
    print()
    print(table(result))
    if dashboard is not None and "windows" in dashboard:
        win = dashboard["windows"]
        result["summary"]["dashboard_window_ratio"] = win["ratio_of_means"]
        stderr = win["pair_ratio_stderr"]
        print(
            f"dashboard open vs closed over {len(win['windows'])} windows of one load at "
            f"c={win['concurrency']}: {win['ratio_of_means']:.3f}x tokens/s (means); adjacent "
            f"pairs median {win['median_pair_ratio']:.3f}x"
            + (
                f", mean {statistics.mean(win['pair_ratios']):.3f}x ± {stderr:.3f}"
                if stderr
                else ""
            )
        )
    if dashboard is not None:
        for lv in dashboard["levels"]:
            print(
                f"dashboard open vs closed, c={lv['concurrency']}: "
                f"{lv['ratio_of_medians']:.3f}x tokens/s (median of {len(lv['open_tokens_per_s'])}"
                f" open, {len(lv['closed_tokens_per_s'])} closed runs); adjacent pairs: median "
                f"{lv['median_pair_ratio']:.3f}x, "
                + ", ".join(f"{r:.3f}" for r in lv["pair_ratios"])
            )
    print(
        f"server exit code {server_info['exit_code']} "
        f"(clean shutdown: {server_info['clean_shutdown']}); "
        f"identical texts server vs engine: "
        + ", ".join(f"{lv['identical_texts']}/{lv['requests']}" for lv in result["levels"])
    )
    print(f"wrote {json_path} and {png_path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
