"""Agents that pause at tool calls: plain LRU against retention, the host tier and
program-aware scheduling, and llama-server with its slot cache, on the same seeded traces.

One command:  .venv/bin/python benchmarks/bench_agents.py [--agents N] [--repeats N]
Writes benchmarks/results/bench_agents.json and .png (job completion time per configuration
and pool size).

The traces (seeded): ``--agents`` concurrent ReAct-style agents share one team system prompt;
each has its own task and ``--min-steps`` to ``--max-steps`` steps. A step is one model call
(``--step-tokens`` generated, EOS ignored) on the agent's whole history; then its tool runs for
a log-normal time (median ``--tool-median-s``, clipped to 50 ms .. ``--tool-max-s``) and
returns 50..``--tool-max-tokens`` tokens, appended with the call's output; the next step sends
the longer prompt. Agents start ``--stagger-s`` apart. Prompts are token ids (random, from the
model's vocabulary): the cache's work does not depend on what they say.

The KV pool holds 100% and 25% of the working set (every agent's final path, the system
prompt once). Configurations, each on a fresh engine of the default model:

- ``plain``: LRU eviction and the default schedule policy (lpm); calls ask for no retention.
- ``retain``: each call asks the engine to retain its path for the agent's next call
  (``retain_s``, keyed by the agent's routing key), released when the agent ends.
- ``retain+tier``: the same, with a host tier (twice the working set) that evicted paths go to.
- ``retain+tier+program``: the same, with the "program" schedule policy (least attained
  service first, as Autellix).
- ``llama-server`` (when built: ``bash benchmarks/setup_llama_cpp.sh``): the same traces as
  concurrent ``/completion`` calls with the prompt cache on, 8 slots each as long as the
  longest agent's path (at least 2048 tokens).

Reported per run: job completion time (an agent's first call to its last answer: mean, p50,
p99), prompt tokens computed (and recomputed after retractions) against the optimum (the
distinct tokens of all prompts' trie, less those a call generated, whose KV its decode already
computed), generated tokens per second over the run. Each configuration runs ``--repeats``
times, alternating; the JSON keeps every run and the spread. Nothing else may run beside it:
the machines are shared and noisy, ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp
from provenance import provenance

from radixlang.runtime.engine import Engine
from radixlang.runtime.request import GenerateRequest

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("plain", "retain", "retain+tier", "retain+tier+program")


@dataclass
class Step:
    tool_s: float  # the tool's latency after this step's call
    tool_tokens: list[int]  # what the tool returns (appended after the call's output)


@dataclass
class Agent:
    task: list[int]
    steps: list[Step]  # the last step's tool is never run: its call is the answer
    start_s: float


def make_traces(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[Agent]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    agents = []
    for i in range(args.agents):
        steps = []
        for _ in range(rng.randint(args.min_steps, args.max_steps)):
            latency = rng.lognormvariate(math.log(args.tool_median_s), args.tool_sigma)
            steps.append(Step(min(max(latency, 0.05), args.tool_max_s),
                              tokens(rng.randint(50, args.tool_max_tokens))))  # fmt: skip
        agents.append(Agent(tokens(args.task_tokens), steps, i * args.stagger_s))
    return system, agents


def working_set_tokens(system: list[int], agents: list[Agent], step_tokens: int) -> int:
    """Every agent's final path, the shared system prompt once."""
    total = len(system)
    for a in agents:
        total += len(a.task) + sum(step_tokens + len(s.tool_tokens) for s in a.steps[:-1])
        total += step_tokens
    return total


class Trie:
    """Distinct token prefixes of the prompts sent (the optimum's count)."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.nodes = 0

    def add(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                self.nodes += 1
            node = child


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def drive(agents: list[Agent], system: list[int], call: Any, done: Any = None) -> dict[str, Any]:
    """Run every agent on its own thread: ``call(i, prompt) -> output ids``; returns the job
    completion times, the prompts sent and the outputs."""
    jct = [0.0] * len(agents)
    sent: list[list[int]] = []
    generated = 0
    lock = threading.Lock()
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def run(i: int, agent: Agent) -> None:
        nonlocal generated
        time.sleep(agent.start_s)
        started = time.perf_counter()
        prompt = system + agent.task
        try:
            for k, step in enumerate(agent.steps):
                out = call(i, prompt)
                with lock:
                    sent.append(list(prompt))
                    generated += len(out)
                if k == len(agent.steps) - 1:
                    break
                time.sleep(step.tool_s)
                prompt = prompt + list(out) + step.tool_tokens
            if done is not None:
                done(i)
        except BaseException as e:
            errors.append(e)
        jct[i] = time.perf_counter() - started

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"jct": jct, "sent": sent, "generated": generated,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def optimum(sent: list[list[int]], step_tokens: int, calls_followed: int) -> int:
    trie = Trie()
    for prompt in sent:
        trie.add(prompt)
    # Each call that another call extends: its output's KV (all but its last token) was
    # computed while decoding.
    return trie.nodes - calls_followed * (step_tokens - 1)


def run_radixlang(config: str, num_blocks: int, tier_bytes: int, system: list[int],
                  agents: list[Agent], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    retain = config != "plain"
    settings: dict[str, Any] = {"num_blocks": num_blocks, "dtype": args.dtype}
    if "tier" in config:
        settings["host_tier_memory"] = str(tier_bytes)
    if config.endswith("program"):
        settings["schedule_policy"] = "program"
    engine = Engine(**settings)
    sampling = {"max_new_tokens": args.step_tokens, "temperature": 0, "ignore_eos": True}

    def call(i: int, prompt: list[int]) -> list[int]:
        request = GenerateRequest(input_ids=prompt, sampling=dict(sampling),
                                  routing_key=f"agent-{i}",
                                  retain_s=args.retain_s if retain else 0.0)  # fmt: skip
        return engine.submit(request).result().output_ids

    def done(i: int) -> None:
        if retain:
            engine.release_retained(f"agent-{i}")

    try:
        engine.generate(system[:8], {"max_new_tokens": 2})  # warm-up: threads, kernels
        engine.flush_cache()
        engine.reset_stats()
        run = drive(agents, system, call, done)
        stats = engine.stats()
        engine.check_integrity()
    finally:
        engine.shutdown()
    computed = stats["prompt_tokens_computed"] + stats["recomputed_tokens"]
    return run | {
        "prompt_tokens_computed": computed,
        "prompt_tokens_reused": stats["prompt_tokens_reused"],
        "retractions": stats["retractions"],
        "evicted_blocks": stats["evicted_blocks"],
        "retained_evicted_blocks": stats["retained_evicted_blocks_total"],
        "tier_loaded_tokens": stats.get("tier_loaded_tokens_total", 0),
    }


def run_llama_server(server: Path, gguf: Path, system: list[int], agents: list[Agent],
                     args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    import httpx

    counts = {"computed": 0, "cached": 0}
    lock = threading.Lock()
    # Each slot holds the longest agent's whole path (its last prompt and answer).
    longest = max(working_set_tokens(system, [a], args.step_tokens) for a in agents)
    ctx = max(llama_cpp.CTX_PER_SLOT, -(-longest // 256) * 256)
    with llama_cpp.LlamaServer(server, gguf, ctx_per_slot=ctx) as srv:
        client = httpx.Client(base_url=srv.url, timeout=600.0, trust_env=False,
                              limits=httpx.Limits(max_connections=len(agents)))  # fmt: skip

        def call(i: int, prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "n_predict": args.step_tokens, "temperature": 0,
                    "ignore_eos": True, "cache_prompt": True, "return_tokens": True,
                    **llama_cpp.NEUTRAL_SAMPLING}  # fmt: skip
            response = client.post("/completion", json=body)
            response.raise_for_status()
            out = response.json()
            with lock:
                counts["computed"] += int(llama_cpp.field(out, "timings/prompt_n", 0))
                counts["cached"] += int(llama_cpp.field(out, "timings/cache_n", 0))
            return list(out.get("tokens") or [])

        client.post("/completion", json={"prompt": system[:8], "n_predict": 2})  # warm-up
        with lock:
            counts.update(computed=0, cached=0)
        try:
            run = drive(agents, system, call)
        finally:
            client.close()
    return run | {"prompt_tokens_computed": counts["computed"],
                  "prompt_tokens_reused": counts["cached"]}  # fmt: skip


_ENGINE_COUNTS = ("retractions", "evicted_blocks", "retained_evicted_blocks", "tier_loaded_tokens")


def summary(run: dict[str, Any], optimum_tokens: int) -> dict[str, Any]:
    jct = run["jct"]
    return {
        "jct_mean_s": statistics.fmean(jct),
        "jct_p50_s": percentile(jct, 0.5),
        "jct_p99_s": percentile(jct, 0.99),
        "seconds": run["seconds"],
        "generated_tokens": run["generated"],
        "throughput_tokens_per_s": run["generated"] / run["seconds"],
        "prompt_tokens_computed": run["prompt_tokens_computed"],
        "prompt_tokens_reused": run["prompt_tokens_reused"],
        "computed_over_optimum": run["prompt_tokens_computed"] / optimum_tokens,
    } | {k: run[k] for k in _ENGINE_COUNTS if k in run}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = list(result["pools"])
    fig, axes = plt.subplots(1, len(pools), figsize=(6 * len(pools), 4.2), squeeze=False)
    for ax, pool in zip(axes[0], pools, strict=True):
        entry = result["pools"][pool]
        names = list(entry["configs"])
        means = [entry["configs"][n]["jct_mean_s"]["median"] for n in names]
        p99 = [entry["configs"][n]["jct_p99_s"]["median"] for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], means, 0.4, label="mean JCT")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99 JCT")
        ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("job completion time (s)")
        ax.set_title(f"KV pool {pool} of the working set")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['agents']} agents, {result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--min-steps", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--task-tokens", type=int, default=40)
    p.add_argument("--step-tokens", type=int, default=16)
    p.add_argument("--tool-max-tokens", type=int, default=400)
    p.add_argument("--tool-median-s", type=float, default=0.3)
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--tool-max-s", type=float, default=3.0)
    p.add_argument("--stagger-s", type=float, default=0.1)
    p.add_argument("--retain-s", type=float, default=30.0)
    p.add_argument("--pools", default="1.0,0.25", help="pool sizes, fractions of the working set")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--llama-gguf", default="f32", help="q4_1 or f32 (the default model's)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_agents.json")
    args = p.parse_args(argv)

    probe = Engine(num_blocks=16, dtype=args.dtype)
    vocab, block_size = probe.runner.vocab_size, probe.pool.block_size
    bytes_per_token = int(probe.runner.kv.describe()["bytes_per_token"])
    probe.shutdown()
    system, agents = make_traces(args, vocab)
    ws = working_set_tokens(system, agents, args.step_tokens)
    calls_followed = sum(len(a.steps) - 1 for a in agents)
    configs = [c for c in args.configs.split(",") if c]
    server = gguf = None
    if args.llama_cpp != "off":
        try:
            server = llama_cpp.find_server(None)
            gguf = llama_cpp.find_gguf(args.llama_gguf)
        except llama_cpp.LlamaCppMissing as e:
            if args.llama_cpp == "on":
                raise SystemExit(f"--llama-cpp on: {e}") from e
            print(f"llama-server baseline skipped: {e}", file=sys.stderr)
    result: dict[str, Any] = {
        "agents": len(agents),
        "steps": sum(len(a.steps) for a in agents),
        "working_set_tokens": ws,
        "block_size": block_size,
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1min": os.getloadavg()[0],
        "args": {k: str(v) for k, v in vars(args).items()},
        "provenance": provenance(argv),
        "traces": {"tool_s": [s.tool_s for a in agents for s in a.steps[:-1]],
                   "tool_tokens": [len(s.tool_tokens) for a in agents for s in a.steps[:-1]]},
        "kv_bytes_per_token": bytes_per_token,
        "pools": {},
    }  # fmt: skip
    for frac in (float(f) for f in args.pools.split(",")):
        # Never less than the longest agent's path needs (with room for a second request).
        longest = max(working_set_tokens(system, [a], args.step_tokens) for a in agents)
        num_blocks = math.ceil(max(ws * frac, 1.5 * longest) / block_size) + 1
        tier_bytes = 2 * ws * bytes_per_token  # the tier holds the working set twice over
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        llama_runs: list[dict[str, Any]] = []
        opt = None
        for rep in range(args.repeats):
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for config in order:
                run = run_radixlang(config, num_blocks, tier_bytes, system, agents, args)
                opt = opt or optimum(run["sent"], args.step_tokens, calls_followed)
                runs[config].append(summary(run, opt))
                s = runs[config][-1]
                print(f"pool {frac:.0%} {config:22s} mean JCT {s['jct_mean_s']:6.2f} s  p99 "
                      f"{s['jct_p99_s']:6.2f} s  computed/optimum "
                      f"{s['computed_over_optimum']:.2f}  {s['throughput_tokens_per_s']:.0f} tok/s",
                      file=sys.stderr)  # fmt: skip
            if server is not None and frac == 1.0:  # llama-server's cache is its slots
                run = run_llama_server(server, gguf, system, agents, args)
                llama_runs.append(summary(run, opt))
                s = llama_runs[-1]
                print(f"           llama-server           mean JCT {s['jct_mean_s']:6.2f} s  p99 "
                      f"{s['jct_p99_s']:6.2f} s  computed/optimum "
                      f"{s['computed_over_optimum']:.2f}", file=sys.stderr)  # fmt: skip
        entry: dict[str, Any] = {"num_blocks": num_blocks, "optimum_prompt_tokens": opt,
                                 "configs": {}, "runs": runs}  # fmt: skip
        all_runs = dict(runs) | ({"llama-server": llama_runs} if llama_runs else {})
        for name, rs in all_runs.items():
            entry["configs"][name] = {
                key: spread([r[key] for r in rs])
                for key in ("jct_mean_s", "jct_p50_s", "jct_p99_s", "throughput_tokens_per_s",
                            "computed_over_optimum", "prompt_tokens_computed")
            }  # fmt: skip
        if llama_runs:
            entry["llama_server_runs"] = llama_runs
        plain = entry["configs"].get("plain")
        if plain:
            for c in entry["configs"].values():
                c["mean_jct_vs_plain"] = plain["jct_mean_s"]["median"] / c["jct_mean_s"]["median"]
                c["p99_jct_vs_plain"] = plain["jct_p99_s"]["median"] / c["jct_p99_s"]["median"]
        result["pools"][f"{frac:.0%}"] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({pool: {n: {k: round(v["median"], 3) if isinstance(v, dict) else round(v, 3)
                                 for k, v in c.items()}
                             for n, c in e["configs"].items()}
                      for pool, e in result["pools"].items()}, indent=1))  # fmt: skip
    return result


if __name__ == "__main__":
    main()
