"""Scale-out on Ray: 1 vs 2 replicas, and round-robin vs cache-aware routing, on program traffic.

One command:  .venv/bin/python benchmarks/bench_scale_out.py [--quick]
Writes benchmarks/results/bench_scale_out.json and .png.

The traffic is many programs written with SGLang's frontend API (``import radixlang as sgl``)
and run by ``--clients`` client threads through one HTTP endpoint (``RuntimeEndpoint`` on a
server over a ``ReplicaSet``), four kinds in turn:

- W1 few-shot: a 20-example question-answering prefix shared by every W1 program, then the
  program's own question; greedy.
- W2 self-consistency: the program's own worked problem (a long unique prefix), ``fork(4)``
  samples at temperature 0.7 (seeded), then a greedy verdict after the join.
- W3 tree-of-thought: a unique problem, branching 2 to depth 2 through ``fork``, then a verdict.
- W4 multi-turn: a chat over a long unique document, ``--turns`` user/assistant turns; greedy.

Three setups run the same traffic: one replica, two replicas with round-robin routing, two
replicas with cache-aware routing. Each replica is a Ray actor with ``--cpus-per-replica`` CPUs
and as many torch threads (1 on a 2-core machine), and ``--kv-memory`` of KV pool. Every setup
starts on flushed caches; ``--rounds`` repeats the three in turn. Per setup and round: wall
time, programs/s, generated tokens/s, prompt tokens computed and reused, the hit rate, blocks
evicted, and the router's decisions.

What a 2-core machine can show, and what it cannot: two single-thread replicas use both cores,
as one two-thread engine would, so 2 vs 1 replica measures the scale-out's overhead and the
work each setup does, not more hardware; round-robin vs cache-aware is the routing's effect on
the prompt tokens computed (the prefix cache's hit rate), which holds at any scale. On a node
with one GPU per replica, throughput should grow with the replicas (each adds a device), and
the prompt-token savings of cache-aware routing turn into time-to-first-token and throughput
at the batch sizes where prefill dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray stays on loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from provenance import provenance

import radixlang as sgl
from radixlang.model_files import DEFAULT_MODEL

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("W1_few_shot", "W2_self_consistency", "W3_tree_of_thought", "W4_multi_turn")
SETUPS = (("1 replica", 1, "cache_aware"), ("2 replicas, round-robin", 2, "round_robin"),
          ("2 replicas, cache-aware", 2, "cache_aware"))  # fmt: skip
_VOCABULARY = (
    "river stone maple cloud lantern harbor orbit velvet copper meadow signal ember quartz "
    "willow canyon pixel falcon tundra saffron glacier market engine ladder silver"
)
_WORDS = _VOCABULARY.split()
EXAMPLES = "".join(f"Q: What is {a} plus {a + 3}?\nA: {2 * a + 3}\n" for a in range(20))


def passage(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@sgl.function
def few_shot(s, i, max_tokens):
    s += EXAMPLES + f"Q: What is {i} plus {i + 7}?\nA:"
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0, stop="\n")


@sgl.function
def self_consistency(s, i, max_tokens):
    s += f"Problem {i}: {passage(i, 120)}\nThink it through.\n"
    forks = s.fork(4)
    for j, f in enumerate(forks):
        f += "Reasoning:" + sgl.gen("r", max_tokens=max_tokens, temperature=0.7, seed=j)
    s += "Verdict:" + sgl.gen("verdict", max_tokens=max_tokens, temperature=0)


@sgl.function
def tree_of_thought(s, i, max_tokens):
    s += f"Puzzle {i}: {passage(1000 + i, 120)}\n"
    level = [s]
    for depth in range(2):
        nxt = []
        for node in level:
            for j, child in enumerate(node.fork(2)):
                child += f"Step {depth}.{j}:" + sgl.gen("t", max_tokens=max_tokens, temperature=0)
                nxt.append(child)
        level = nxt
    s += "Answer:" + sgl.gen("answer", max_tokens=max_tokens, temperature=0)


@sgl.function
def multi_turn(s, i, max_tokens, turns):
    s += sgl.system(f"Document {i}: {passage(2000 + i, 160)}")
    for t in range(turns):
        s += sgl.user(f"Question {t} about the document?")
        s += sgl.assistant(sgl.gen(f"a{t}", max_tokens=max_tokens, temperature=0))


def run_program(kind: str, i: int, backend: Any, args: argparse.Namespace) -> None:
    common = {"i": i, "max_tokens": args.max_tokens, "backend": backend}
    if kind == "W1_few_shot":
        few_shot.run(**common)
    elif kind == "W2_self_consistency":
        self_consistency.run(**common)
    elif kind == "W3_tree_of_thought":
        tree_of_thought.run(**common)
    else:
        multi_turn.run(**common, turns=args.turns)


def run_traffic(url: str, args: argparse.Namespace) -> float:
    """Every program, ``args.clients`` at a time; returns the wall time."""
    backend = sgl.RuntimeEndpoint(url)
    jobs = [(KINDS[i % len(KINDS)], i) for i in range(args.programs)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        for future in [pool.submit(run_program, k, i, backend, args) for k, i in jobs]:
            future.result()
    return time.perf_counter() - start


def measure(replicas: Any, url: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    replicas.router.policy = policy
    replicas.flush_cache(60)
    replicas.reset_stats()
    wall = run_traffic(url, args)
    s = replicas.stats()
    return {
        "wall_s": wall,
        "programs_per_s": args.programs / wall,
        "generated_tokens": s["generated_tokens"],
        "generated_tokens_per_s": s["generated_tokens"] / wall,
        "prompt_tokens": s["prompt_tokens"],
        "prompt_tokens_computed": s["prompt_tokens_computed"],
        "prompt_tokens_reused": s["prompt_tokens_reused"],
        "cache_hit_rate": s["cache_hit_rate"],
        "evicted_blocks": s["evicted_blocks"],
        "retractions": s["retractions"],
        "routed": {k: s[f"routed_{k}"] for k in ("prefix", "key", "load", "round_robin")},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": runs}
    for key in ("wall_s", "programs_per_s", "generated_tokens_per_s", "prompt_tokens_computed",
                "cache_hit_rate"):  # fmt: skip
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[key + "_spread"] = [min(values), max(values)]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["setup"] for s in result["setups"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("generated_tokens_per_s", "generated tokens / s"),
              ("prompt_tokens_computed", "prompt tokens computed"),
              ("cache_hit_rate", "prefix cache hit rate"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [s[key] for s in result["setups"]]
        lows = [v - s[key + "_spread"][0] for v, s in zip(values, result["setups"], strict=True)]
        highs = [s[key + "_spread"][1] - v for v, s in zip(values, result["setups"], strict=True)]
        ax.bar(range(len(names)), values, yerr=[lows, highs], capsize=4,
               color=["#8da0cb", "#fc8d62", "#66c2a5"])  # fmt: skip
        ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=8)
        ax.set_title(title)
    fig.suptitle(f"{result['programs']} programs (W1-W4), {result['clients']} clients; "
                 f"median of {result['rounds']} rounds, bars: min-max")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic inference: a request's tokens do not depend on its batch, "
                   "so every setup generates the same text (the test's check)")  # fmt: skip
    p.add_argument("--kv-memory", default="256MiB", help="per replica")
    p.add_argument("--cpus-per-replica", type=int, default=1)
    p.add_argument("--programs", type=int, default=48)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster")
    p.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.programs, args.clients, args.max_tokens, args.turns, args.rounds = 8, 4, 4, 2, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixlang.cluster.replica_set import ReplicaSet, init_ray
    from radixlang.server.app import serve_in_thread

    init_ray(args.ray_address)
    engine = {"dtype": args.dtype, "kv_memory": args.kv_memory, "deterministic": args.deterministic}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in SETUPS}
    info: dict[str, Any] = {}
    for r in range(args.rounds):
        # One replica set at a time, so the replicas measured are the only ones with CPUs;
        # the two routings alternate which goes first.
        for count in (1, 2):
            order = [s for s in SETUPS if s[1] == count]
            if r % 2:
                order.reverse()
            cpus = args.cpus_per_replica
            with (
                ReplicaSet(args.model, count, cpus_per_replica=cpus, **engine) as rs,
                serve_in_thread(rs, dashboard=False) as srv,
            ):
                info = rs.replica_info[0]
                # A program of each kind per replica first: first requests pay for warm-up.
                warm = {**vars(args), "programs": 4 * count, "clients": 4 * count}
                run_traffic(srv.url, argparse.Namespace(**warm))
                for name, _, policy in order:
                    entry = measure(rs, srv.url, policy, args)
                    runs[name].append(entry)
                    print(f"round {r + 1} {name}: {entry['wall_s']:.1f} s, "
                          f"{entry['generated_tokens_per_s']:.1f} tok/s, computed "
                          f"{entry['prompt_tokens_computed']} prompt tokens, hit rate "
                          f"{entry['cache_hit_rate']:.2f}", file=sys.stderr)  # fmt: skip
    setups = [{"setup": name, "replicas": count, "routing": policy, **summarize(runs[name])}
              for name, count, policy in SETUPS]  # fmt: skip
    by = {s["setup"]: s for s in setups}
    aware, in_turn, one = (by[n] for n in (SETUPS[2][0], SETUPS[1][0], SETUPS[0][0]))
    result = {
        "benchmark": "bench_scale_out",
        "model": args.model,
        "dtype": info["dtype"],
        "deterministic": args.deterministic,
        "kv_memory_per_replica": args.kv_memory,
        "cpus_per_replica": args.cpus_per_replica,
        "programs": args.programs,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "turns": args.turns,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "provenance": provenance(argv),
        "setups": setups,
        "cache_aware_over_round_robin_prompt_tokens_computed": (
            aware["prompt_tokens_computed"] / max(in_turn["prompt_tokens_computed"], 1)
        ),
        "cache_aware_over_round_robin_throughput": (
            aware["generated_tokens_per_s"] / in_turn["generated_tokens_per_s"]
        ),
        "two_over_one_replica_throughput": (
            aware["generated_tokens_per_s"] / one["generated_tokens_per_s"]
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scale_out.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_scale_out.png")
    print(json.dumps({k: v for k, v in result.items() if k != "setups"}, indent=2))
    return result


if __name__ == "__main__":
    main()
