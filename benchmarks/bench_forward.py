"""Forward-pass speed of the native model runner against transformers, side by side.

One command:  .venv/bin/python benchmarks/bench_forward.py
Writes benchmarks/results/bench_forward.json and .png.

For each dtype (float32 and bfloat16 by default), on the default model:
1. Prefill: tokens per second for one prompt of 512 and of 2,048 tokens.
2. Decode: the time of one decode step at batch 1, 8 and 32, every sequence with a 400-token
   context. radixlang runs its packed batch over the paged KV cache, twice: with the kernels
   it picks (on CPUs the C++ paged attention of kernels/native.py, reading K/V blocks in place)
   and with the torch path forced (``RADIXLANG_KERNELS=torch``: blocks gathered into a copy,
   then SDPA; the path before the native kernel). transformers runs its own forward (dynamic
   cache, sdpa attention, a padded batch with an attention mask).
3. The step's floors on this machine: bytes a step must read (weights once, every cached
   token's K and V) over the measured read bandwidth, and its matmul FLOPs over the measured
   matmul rate; ``over_memory_floor`` is the step time over the first.
Every variant is measured alternately in the same process, step for step, and compared by the
median; the ratios are what to read, not the absolute times (the machines are shared).
Targets: at batch 32 a decode step at least 2x faster than transformers'; at batch 1 no more
than 0.7x transformers' time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
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


@contextlib.contextmanager
def kernels_forced(mode: str | None):
    """``RADIXLANG_KERNELS`` set to ``mode`` (None: left as it is) while the block runs."""
    before = os.environ.get("RADIXLANG_KERNELS")
    if mode is not None:
        os.environ["RADIXLANG_KERNELS"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RADIXLANG_KERNELS", None)
        else:
            os.environ["RADIXLANG_KERNELS"] = before


def machine_rates(dtype: torch.dtype) -> dict[str, float]:
    """Read bandwidth (bytes/s, summing a 256 MiB tensor) and a large matmul's FLOP/s."""
    big = torch.ones(64 * 2**20, dtype=torch.float32)
    seconds = min(timed(big.sum)[0] for _ in range(5))
    a = torch.randn(512, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    flops_s = min(timed(lambda: a @ b)[0] for _ in range(5))
    return {
        "read_bytes_per_s": big.numel() * 4 / seconds,
        "matmul_flops_per_s": 2 * 512 * 2048 * 2048 / flops_s,
    }


def step_floors(runner: ModelRunner, batch: int, context: int, rates: dict[str, float]) -> dict:
    """What a decode step must at least cost: bytes read and matmul FLOPs."""
    model = runner.model
    weight_bytes = model.num_parameter_bytes - model.embed.numel() * model.embed.element_size()
    kv = runner.kv
    kv_bytes_per_token = 2 * len(kv.layers) * kv.layers[0].kv_heads * kv.layers[0].head_dim
    kv_bytes = batch * context * kv_bytes_per_token * kv.k.element_size()
    matmul_params = (
        sum(
            layer.qkv.out_features * layer.qkv.in_features
            + layer.o.out_features * layer.o.in_features
            + layer.gate_up.out_features * layer.gate_up.in_features
            + layer.down.out_features * layer.down.in_features
            for layer in model.layers
        )
        + model.lm_head.out_features * model.lm_head.in_features
    )
    flops = 2 * batch * matmul_params
    return {
        "bytes_read": weight_bytes + kv_bytes,
        "memory_floor_ms": (weight_bytes + kv_bytes) / rates["read_bytes_per_s"] * 1e3,
        "matmul_flops": flops,
        "compute_floor_ms": flops / rates["matmul_flops_per_s"] * 1e3,
    }


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
    ours, torch_path, theirs = [], [], []
    for step in range(steps + 1):  # step 0 warms up and is dropped
        length = context + step
        seqs = [SequenceInput(next_ids[b], length, tables[b]) for b in range(batch)]
        ours.append(timed(lambda seqs=seqs: runner.forward(seqs))[0])
        # The same step again on the torch kernels (it rewrites the same K/V slots).
        with kernels_forced("torch"):
            torch_path.append(timed(lambda seqs=seqs: runner.forward(seqs))[0])
        mask = torch.ones(batch, length + 1, dtype=torch.long)
        with torch.inference_mode():
            seconds, _ = timed(
                lambda mask=mask: hf(torch.tensor(next_ids), attention_mask=mask, cache=cache)
            )
        theirs.append(seconds)
    ours_s, theirs_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    torch_s = statistics.median(torch_path[1:])
    return {
        "batch": batch,
        "context": context,
        "radixlang_ms": ours_s * 1e3,
        "radixlang_ms_spread": [min(ours[1:]) * 1e3, max(ours[1:]) * 1e3],
        "radixlang_torch_kernels_ms": torch_s * 1e3,
        "native_over_torch_kernels_speedup": torch_s / ours_s,
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
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=400)
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
        "provenance": provenance(argv),
        "runs": [],
    }
    blocks_per_seq = -(-(max(args.context + args.steps + 1, *args.prefill_tokens)) // 16)
    for name in args.dtypes:
        dtype = resolve_dtype(name)
        runner = ModelRunner(files, dtype=dtype, num_blocks=max(args.batches) * blocks_per_seq)
        hf = load_transformers(files.path, dtype)
        rates = machine_rates(dtype)
        run = {"dtype": name, "kv_cache": runner.kv.describe(), "machine_rates": rates}
        run["prefills"] = []
        for tokens in args.prefill_tokens:
            row = bench_prefill(runner, hf, tokens, args.repeats, args.seed)
            run["prefills"].append(row)
            print(f"{name} prefill: {json.dumps(row)}", flush=True)
        run["prefill"] = run["prefills"][0]
        run["decode"] = []
        for batch in args.batches:
            row = bench_decode(runner, hf, batch, args.context, args.steps, args.seed)
            row.update(step_floors(runner, batch, args.context, rates))
            row["over_memory_floor"] = row["radixlang_ms"] / row["memory_floor_ms"]
            row["over_larger_floor"] = row["radixlang_ms"] / max(
                row["memory_floor_ms"], row["compute_floor_ms"]
            )
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
