"""A decode loop alone and beside a CPU-burning process: how much a busy neighbour costs.

One command:  .venv/bin/python benchmarks/bench_shared_cores.py
Writes benchmarks/results/bench_shared_cores.json and .png.

The engine generates ``--batch`` requests of ``--new-tokens`` tokens each (greedy, EOS ignored,
short prompts) on the default model, four ways, each in a fresh process:
- fixed threads (every core, the engine's thread count never changes), alone;
- fixed threads beside a process that burns one core (a Python busy loop);
- adaptive threads (the engine's default: ``runtime/cpu_threads.py`` sets the thread count to
  the cores other processes leave), alone;
- adaptive threads beside the burner.
It reports decode tokens/s and the slowdown beside the burner against alone. A neighbour that
takes one of two cores costs at best 2x; the target is at most 2.5x with adaptive threads.
Runs alternate (alone, beside, alone, ...) ``--rounds`` times; medians and spreads are reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from provenance import provenance

CONFIGS = {"fixed": False, "adaptive": True}


def burn() -> None:
    while True:
        pass


def decode_run(adaptive: bool, batch: int, new_tokens: int, model: str) -> dict[str, Any]:
    """One engine run in this process: decode tokens/s after a warm-up request."""
    from radixlang.runtime import Engine, SamplingParams

    engine = Engine(model, adapt_threads=adaptive)
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        prompts = [[1, 2, 3, 4 + i] for i in range(batch)]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.output_ids) for o in outputs)
        stats = engine.stats()
    finally:
        engine.shutdown()
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "threads_at_end": stats.get("cpu_threads"),
        "thread_changes": stats.get("cpu_thread_changes"),
    }


def run_in_subprocess(adaptive: bool, args: argparse.Namespace) -> dict[str, Any]:
    here = str(Path(__file__).parent)
    call = f"b.decode_run({adaptive!r}, {args.batch}, {args.new_tokens}, {args.model!r})"
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import bench_shared_cores as b; "
        f"print('RESULT', json.dumps({call}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"decode run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(result["configs"])
    for j, where in enumerate(("alone", "beside_burner")):
        xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
        values = [result["configs"][n][where]["tokens_per_s_median"] for n in names]
        bars = ax.bar(xs, values, 0.38, label=where.replace("_", " "))
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(
        [f"{n} threads\n{result['configs'][n]['slowdown']:.2f}x slower beside" for n in names]
    )
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"batch {result['config']['batch']}, one core burnt by another process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from radixlang.model_files import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {"alone": [], "beside_burner": []} for c in args.configs
    }
    for _ in range(args.rounds):
        for name in args.configs:
            runs[name]["alone"].append(run_in_subprocess(CONFIGS[name], args))
            burner = multiprocessing.Process(target=burn, daemon=True)
            burner.start()
            try:
                time.sleep(1.0)  # let the scheduler see the burner before the engine starts
                runs[name]["beside_burner"].append(run_in_subprocess(CONFIGS[name], args))
            finally:
                burner.terminate()
                burner.join()
            print(name, {k: round(v[-1]["tokens_per_s"], 1) for k, v in runs[name].items()})
    result: dict[str, Any] = {
        "benchmark": "bench_shared_cores",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "provenance": provenance(argv),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "configs": {},
    }
    for name, by_where in runs.items():
        entry: dict[str, Any] = {}
        for where, rows in by_where.items():
            rates = [r["tokens_per_s"] for r in rows]
            entry[where] = {
                "tokens_per_s_median": statistics.median(rates),
                "tokens_per_s_spread": [min(rates), max(rates)],
                "runs": rows,
            }
        entry["slowdown"] = (
            entry["alone"]["tokens_per_s_median"] / entry["beside_burner"]["tokens_per_s_median"]
        )
        result["configs"][name] = entry
        print(f"{name:9s} slowdown beside a burner: {entry['slowdown']:.2f}x", flush=True)
    if "adaptive" in result["configs"]:
        result["target_slowdown_at_most_2.5"] = result["configs"]["adaptive"]["slowdown"] <= 2.5
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_shared_cores.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_shared_cores.png")
    print(f"wrote {args.out / 'bench_shared_cores.json'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
