"""Memory beyond the pool: the host tier, swap against recompute preemption, and the memory
report's figures on the same workloads.

One command:  .venv/bin/python benchmarks/bench_memory.py
Writes benchmarks/results/bench_memory.json and .png.

1. **Host tier.** ``--prefixes`` few-shot prefixes of ``--prefix-tokens`` tokens each are asked a
   new short question every round, for ``--rounds`` rounds (one batch per round, greedy). The KV
   pool holds ``--tier-pool-fraction`` of the working set (the prefixes with their questions and
   answers), so each round evicts what the next one needs. Run without a tier (evicted prefixes
   are dropped and computed again) and with one (``--tier-memory``; evicted prefixes move there
   and are loaded back), same process, same prompts. Reported: prompt tokens computed, tokens
   loaded from the tier, wall time, and whether the outputs are identical.
2. **Preemption.** ``--requests`` prompts of ``--prompt-tokens`` tokens, ``--new-tokens`` each,
   submitted at once, with a pool of ``--preempt-pool-fraction`` of their working set: requests
   are retracted over and over. Run with a pool that holds everything (the reference), with
   recompute preemption (no tier) and with swap preemption (a tier), same process. Reported:
   wall time, retractions, tokens computed again, blocks swapped out, tokens loaded back, and
   whether the outputs equal the reference's.
3. **Memory report.** Every run takes ``Engine.memory_report()`` at its busiest step (most
   requests running): allocated slots against live tokens (the last blocks' internal
   fragmentation), sharing, and the tier's occupancy.

Token ids are drawn from a seeded generator (memory behaviour does not depend on the text). The
machine is shared and noisy: read wall times as a ratio within one run; ``--repeats`` reruns the
whole comparison and reports each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL
from radixlang.runtime.engine import Engine
from radixlang.runtime.memory_report import MemoryReport

GREEDY = {"temperature": 0.0, "ignore_eos": True}
TIER_TARGET_RATIO = 5.0  # prompt tokens computed without the tier / with it, at least
SLOT_TARGET = 1.05  # allocated slots / live tokens, at most


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=6)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=12)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tier-pool-fraction", type=float, default=0.25)
    p.add_argument("--tier-memory", default="1GiB")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--preempt-pool-fraction", type=float, default=0.10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p.parse_args(argv)


def run_batch(
    engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]
) -> tuple[list[list[int]], MemoryReport | None]:
    """Submit, step until done; the outputs and the memory report at the busiest step."""
    handles = [engine.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    busiest, report = -1, None
    while not all(h.done for h in handles):
        engine.step()
        running = len(engine.scheduler.running)
        if running > busiest:
            busiest, report = running, engine.memory_report()
    return [h.result().output_ids for h in handles], report


def report_figures(report: MemoryReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    d = report.to_dict()
    return {
        "running_requests": report.running_requests,
        "blocks_used": report.blocks_used,
        "slots_allocated": report.slots_allocated,
        "live_tokens": report.tokens_live,
        "allocated_per_live": report.allocated_per_live,
        "fragmentation": report.fragmentation,
        "sharing": report.sharing,
        "tier": d.get("tier"),
    }


def engine_for(args: argparse.Namespace, num_blocks: int, **kw: Any) -> Engine:
    return Engine(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=num_blocks,
        background=False,
        **kw,
    )


def tier_comparison(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(1, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)
    ]
    rounds = [
        [p + [rng.randrange(1, vocab) for _ in range(args.question_tokens)] for p in prefixes]
        for _ in range(args.rounds)
    ]
    per_request = args.prefix_tokens + args.question_tokens + args.answer_tokens
    working_set = args.prefixes * per_request
    bs = args.block_size
    num_blocks = max(
        math.ceil(working_set * args.tier_pool_fraction / bs), math.ceil(per_request / bs) + 2
    )
    params = [GREEDY | {"max_new_tokens": args.answer_tokens}] * args.prefixes
    runs: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, tier in (("no_tier", None), ("tier", args.tier_memory)):
        engine = engine_for(args, num_blocks, host_tier_memory=tier)
        busiest: MemoryReport | None = None
        start = time.perf_counter()
        outs: list[list[int]] = []
        for batch in rounds:
            got, report = run_batch(engine, batch, params)
            outs += got
            if report is not None and (
                busiest is None or report.running_requests > busiest.running_requests
            ):
                busiest = report
        wall = time.perf_counter() - start
        s = engine.stats()
        runs[name] = {
            "wall_s": wall,
            "prompt_tokens": s["prompt_tokens"],
            "prompt_tokens_computed": s["prompt_tokens_computed"],
            "prompt_tokens_reused": s["prompt_tokens_reused"],
            "tier_loaded_tokens": s["tier_loaded_tokens"],
            "tier_written_blocks": s.get("tier_written_blocks_total", 0),
            "evicted_blocks": s["evicted_blocks"],
            "tier_copies": engine.host_tier.stats() if engine.host_tier is not None else None,
            "memory_report": report_figures(busiest),
        }
        outputs[name] = outs
        engine.check_integrity()
        engine.shutdown()
    computed = runs["no_tier"]["prompt_tokens_computed"], runs["tier"]["prompt_tokens_computed"]
    return {
        "pool_blocks": num_blocks,
        "working_set_tokens": working_set,
        "pool_tokens": num_blocks * bs,
        "runs": runs,
        "computed_ratio": computed[0] / max(1, computed[1]),
        "speedup": runs["no_tier"]["wall_s"] / runs["tier"]["wall_s"],
        "outputs_identical": outputs["no_tier"] == outputs["tier"],
    }


def preemption_comparison(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    params = [GREEDY | {"max_new_tokens": args.new_tokens}] * args.requests
    per_request = args.prompt_tokens + args.new_tokens
    working_set = args.requests * per_request
    bs = args.block_size
    roomy = math.ceil(working_set / bs) + args.requests + 8
    tight = max(
        math.ceil(working_set * args.preempt_pool_fraction / bs), math.ceil(per_request / bs) + 2
    )
    configs = (
        ("unpressured", roomy, {}),
        ("recompute", tight, {"preemption": "recompute"}),
        ("swap", tight, {"preemption": "swap", "host_tier_memory": args.tier_memory}),
    )
    runs: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, blocks, kw in configs:
        engine = engine_for(args, blocks, **kw)
        start = time.perf_counter()
        outs, report = run_batch(engine, prompts, params)
        wall = time.perf_counter() - start
        s = engine.stats()
        runs[name] = {
            "pool_blocks": blocks,
            "wall_s": wall,
            "retractions": s["retractions"],
            "recomputed_tokens": s["recomputed_tokens"],
            "swapped_out_blocks": s["swapped_out_blocks"],
            "tier_loaded_tokens": s["tier_loaded_tokens"],
            "steps": s["steps"],
            "tier_copies": engine.host_tier.stats() if engine.host_tier is not None else None,
            "memory_report": report_figures(report),
        }
        outputs[name] = outs
        engine.check_integrity()
        engine.shutdown()
    for name in ("recompute", "swap"):
        runs[name]["outputs_equal_unpressured"] = outputs[name] == outputs["unpressured"]
    return {
        "working_set_tokens": working_set,
        "pool_fraction": args.preempt_pool_fraction,
        "runs": runs,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = result["repeats"][-1]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    tier = rep["tier"]["runs"]
    names = ["no_tier", "tier"]
    ax = axes[0]
    ax.bar(names, [tier[n]["prompt_tokens_computed"] for n in names], color=["#999", "#2a7"])
    ax.set_ylabel("prompt tokens computed")
    ax.set_title(
        f"host tier: {rep['tier']['computed_ratio']:.1f}x fewer computed, "
        f"{rep['tier']['speedup']:.2f}x faster"
    )
    for i, n in enumerate(names):
        ax.text(i, tier[n]["prompt_tokens_computed"], f"{tier[n]['wall_s']:.1f} s", ha="center",
                va="bottom")  # fmt: skip
    pre = rep["preemption"]["runs"]
    names = ["unpressured", "recompute", "swap"]
    ax = axes[1]
    ax.bar(names, [pre[n]["wall_s"] for n in names], color=["#999", "#c63", "#2a7"])
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"preemption, pool at {rep['preemption']['pool_fraction']:.0%} of working set")
    for i, n in enumerate(names):
        ax.text(i, pre[n]["wall_s"], f"{pre[n]['recomputed_tokens']} recomputed", ha="center",
                va="bottom", fontsize=8)  # fmt: skip
    ax = axes[2]
    labels, ratios = [], []
    for part, runs in (("tier", tier), ("preempt", pre)):
        for n, r in runs.items():
            if r["memory_report"] and r["memory_report"]["allocated_per_live"]:
                labels.append(f"{part}:{n}")
                ratios.append(r["memory_report"]["allocated_per_live"])
    ax.bar(labels, ratios, color="#47a")
    ax.axhline(SLOT_TARGET, color="red", linestyle="--", label=f"target {SLOT_TARGET}")
    ax.set_ylim(0.95, max([SLOT_TARGET, *ratios]) * 1.02)
    ax.set_ylabel("allocated slots / live tokens")
    ax.set_title("memory report at the busiest step")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    probe = engine_for(args, 8)
    vocab = min(probe.runner.vocab_size, 20000)
    dtype = probe.dtype
    model_name = probe.files.name
    probe.shutdown()
    repeats = []
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}: host tier ...", file=sys.stderr, flush=True)
        tier = tier_comparison(args, vocab)
        print(f"repeat {i + 1}/{args.repeats}: preemption ...", file=sys.stderr, flush=True)
        repeats.append({"tier": tier, "preemption": preemption_comparison(args, vocab)})
    last = repeats[-1]
    slot_ratios = [
        r["memory_report"]["allocated_per_live"]
        for part in (last["tier"]["runs"], last["preemption"]["runs"])
        for r in part.values()
        if r["memory_report"] and r["memory_report"]["allocated_per_live"]
    ]
    result = {
        "benchmark": "bench_memory",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": model_name,
        "dtype": dtype,
        "provenance": provenance(argv),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "repeats": repeats,
        "targets": {
            "tier_computes_5x_fewer_prompt_tokens": all(
                r["tier"]["computed_ratio"] >= TIER_TARGET_RATIO for r in repeats
            ),
            "tier_faster_in_wall_time": all(r["tier"]["speedup"] > 1 for r in repeats),
            "tier_outputs_identical": all(r["tier"]["outputs_identical"] for r in repeats),
            "preemption_outputs_equal_unpressured": all(
                r["preemption"]["runs"][n]["outputs_equal_unpressured"]
                for r in repeats
                for n in ("recompute", "swap")
            ),
            "allocated_slots_within_1.05_of_live": max(slot_ratios, default=0) <= SLOT_TARGET,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_memory.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_memory.png")
    summary = {
        "computed_ratio": [r["tier"]["computed_ratio"] for r in repeats],
        "tier_speedup": [r["tier"]["speedup"] for r in repeats],
        "preemption_wall_s": [
            {n: round(v["wall_s"], 2) for n, v in r["preemption"]["runs"].items()} for r in repeats
        ],
        "targets": result["targets"],
    }
    print(json.dumps(summary, indent=2))
    return result


if __name__ == "__main__":
    main()
