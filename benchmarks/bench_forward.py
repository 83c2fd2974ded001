"""Forward-pass speed of the native model runner against transformers, side by side.

One command:  .venv/bin/python benchmarks/bench_forward.py
Writes benchmarks/results/bench_forward.json and .png.

For each dtype (float32 and bfloat16 by default), on the default model:
1. Prefill: tokens per second for one 512-token prompt.
2. Decode: the time of one decode step at batch 1, 8 and 32, every sequence with a 256-token
   context. radixlang runs its packed batch over the paged KV cache; transformers runs its own
   forward (dynamic cache, sdpa attention, a padded batch with an attention mask).
The two are measured alternately in the same process, step for step, and compared by the
median; the ratios are what to read, not the absolute times (the machines are shared).
Targets: at batch 32 a decode step at least 2x faster than transformers'; at batch 1 no more
than 0.7x transformers' time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixlang.models import DEFAULT_MODEL, load_model_files
from radixlang.runtime import ModelRunner, SequenceInput, resolve_dtype


def load_transformers(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and what it returned."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, length), generator=gen).tolist()


def bench_prefill(runner: ModelRunner, hf: Any, tokens: int, repeats: int, seed: int) -> dict:
    ids = prompts(1, tokens, runner.vocab_size, seed)[0]
    table = list(range(-(-tokens // runner.block_size)))
    ours, theirs = [], []
    diff = 0.0
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        seconds, out = timed(lambda: runner.forward([SequenceInput(ids, 0, table)]))
        ours.append(seconds)
        with torch.inference_mode():
            seconds, ref = timed(lambda: hf(torch.tensor([ids])).logits[0, -1])
        theirs.append(seconds)
        diff = float((out.logits[0] - ref.float()).abs().max())
    ours_s, theirs_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {
        "tokens": tokens,
        "radixlang_tokens_per_s": tokens / ours_s,
        "transformers_tokens_per_s": tokens / theirs_s,
        "speedup": theirs_s / ours_s,
        "max_abs_logit_diff": diff,
    }


def bench_decode(
    runner: ModelRunner, hf: Any, batch: int, context: int, steps: int, seed: int
) -> dict:
    ids = prompts(batch, context, runner.vocab_size, seed)
    blocks_per_seq = -(-(context + steps + 1) // runner.block_size)
    if batch * blocks_per_seq > runner.num_blocks:
        raise SystemExit(
            f"the KV cache holds {runner.num_blocks} blocks; need {batch * blocks_per_seq}"
        )
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    runner.forward([SequenceInput(ids[b], 0, tables[b]) for b in range(batch)])
    with torch.inference_mode():
        out = hf(torch.tensor(ids), attention_mask=torch.ones(batch, context, dtype=torch.long))
    cache = out.cache
    next_ids = [[7] for _ in range(batch)]
    ours, theirs = [], []
    for step in range(steps + 1):  # step 0 warms up and is dropped
        length = context + step
        seqs = [SequenceInput(next_ids[b], length, tables[b]) for b in range(batch)]
        ours.append(timed(lambda seqs=seqs: runner.forward(seqs))[0])
        mask = torch.ones(batch, length + 1, dtype=torch.long)
        with torch.inference_mode():
            seconds, _ = timed(
                lambda mask=mask: hf(torch.tensor(next_ids), attention_mask=mask, cache=cache)
            )
        theirs.append(seconds)
    ours_s, theirs_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {
        "batch": batch,
        "context": context,
        "radixlang_ms": ours_s * 1e3,
        "transformers_ms": theirs_s * 1e3,
        "speedup": theirs_s / ours_s,
        "time_ratio": ours_s / theirs_s,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        labels = [f"b{d['batch']}" for d in run["decode"]]
        xs = range(len(labels))
        ax.bar(
            [x - 0.2 for x in xs],
            [d["radixlang_ms"] for d in run["decode"]],
            0.4,
            label="radixlang",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [d["transformers_ms"] for d in run["decode"]],
            0.4,
            label="transformers",
        )
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("decode step (ms)")
        prefill = run["prefill"]
        ax.set_title(f"{run['dtype']}: prefill {prefill['speedup']:.2f}x faster")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3, help="prefill passes timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    files = load_model_files(args.model)
    result: dict = {
        "benchmark": "bench_forward",
        "model": files.name,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "runs": [],
    }
    blocks_per_seq = -(-(max(args.context + args.steps + 1, args.prefill_tokens)) // 16)
    for name in args.dtypes:
        dtype = resolve_dtype(name)
        runner = ModelRunner(files, dtype=dtype, num_blocks=max(args.batches) * blocks_per_seq)
        hf = load_transformers(files.path, dtype)
        run = {"dtype": name, "kv_cache": runner.kv.describe()}
        run["prefill"] = bench_prefill(runner, hf, args.prefill_tokens, args.repeats, args.seed)
        print(f"{name} prefill: {json.dumps(run['prefill'])}", flush=True)
        run["decode"] = []
        for batch in args.batches:
            row = bench_decode(runner, hf, batch, args.context, args.steps, args.seed)
            run["decode"].append(row)
            print(f"{name} decode: {json.dumps(row)}", flush=True)
        by_batch = {d["batch"]: d for d in run["decode"]}
        run["targets"] = {}
        if 32 in by_batch:
            run["targets"]["batch32_speedup_at_least_2"] = by_batch[32]["speedup"] >= 2.0
        if 1 in by_batch:
            run["targets"]["batch1_time_ratio_at_most_0.7"] = by_batch[1]["time_ratio"] <= 0.7
        result["runs"].append(run)
        del runner, hf

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_forward.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_forward.png")
    print(f"wrote {args.out / 'bench_forward.json'}")
    return result


if __name__ == "__main__":
    main()
