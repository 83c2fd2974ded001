"""Triton split-KV decode attention on a GPU: time and achieved K/V bandwidth vs the torch path.

One command (needs a CUDA GPU):  .venv/bin/python benchmarks/bench_decode_attention_gpu.py
Writes benchmarks/results/bench_decode_attention_gpu.json and prints it.

Shape: the default model's attention (9 query heads over 3 KV heads, head_dim 64), bfloat16,
block size 16; ``--batch`` sequences (64) of ``--context`` cached tokens (2048) each, their
blocks drawn in random order from one pool. Each path is warmed up, then timed with CUDA events
around every call (``--iters``, 50), the L2 cache flushed before each; the median is reported.
The Triton call reads nothing back to the host, so it is captured in a CUDA graph and the graph
replayed (kernel time without Python launch overhead; the eager time is reported too). The
torch path syncs on ``seq_lens`` and runs eagerly. Bandwidth counts the K and V bytes the
attention must read: batch * context * kv_heads * head_dim * 2 (K and V) * 2 bytes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from provenance import provenance

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2


def time_calls(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` (CUDA events), after ``warmup`` calls."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()  # so every call reads K/V from HBM, not from a warm L2
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def summary(times: list[float], kv_bytes: int) -> dict:
    median = statistics.median(times)
    return {
        "median_ms": round(median, 5),
        "min_ms": round(min(times), 5),
        "kv_bandwidth_gb_s": round(kv_bytes / (median * 1e-3) / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_decode_attention_gpu needs a CUDA GPU and none is available; nothing was run",
            file=sys.stderr,
        )
        raise SystemExit(2)

    from radixlang.kernels import reference
    from radixlang.kernels.layout import PagedKV

    # By module path: the package's decode_attention dispatcher would also pick Triton on CUDA,
    # but this names the kernel under test explicitly.
    paged_attention = importlib.import_module("radixlang.kernels.triton_decode_attention")

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    batch, context = args.batch, args.context
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 16
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = PagedKV(
        torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE),
        torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE),
    )
    order = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * blocks_per_seq]
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    call_args = (q, cache, block_tables, seq_lens, scale)
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * cache.k.element_size()

    def run_triton() -> torch.Tensor:
        return paged_attention.decode_attention(*call_args)

    def run_torch() -> torch.Tensor:
        return reference.decode_attention(*call_args)

    got = run_triton()  # compiles the kernels
    want = run_torch()
    torch.cuda.synchronize()
    max_abs_diff = (got.float() - want.float()).abs().max().item()

    eager = time_calls(run_triton, args.warmup, args.iters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run_triton()
    graph.replay()
    torch.cuda.synchronize()
    graph_matches = torch.equal(graph_out, got)
    replayed = time_calls(graph.replay, args.warmup, args.iters)
    torch_times = time_calls(run_torch, args.warmup, args.iters)

    triton_result = summary(replayed, kv_bytes)
    torch_result = summary(torch_times, kv_bytes)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
        "provenance": provenance(argv),
        "shape": {
            "batch": batch,
            "context": context,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE).removeprefix("torch."),
            "partition_tokens": paged_attention.DEFAULT_PARTITION_TOKENS,
        },
        "kv_bytes_read": kv_bytes,
        "iters": args.iters,
        "triton_decode": {
            **triton_result,
            "timing": "CUDA graph replay",
            "eager": summary(eager, kv_bytes),
        },
        "torch_decode": {**torch_result, "timing": "eager"},
        "speedup_vs_torch": round(torch_result["median_ms"] / triton_result["median_ms"], 2),
        "correctness": {
            "max_abs_diff_vs_torch": max_abs_diff,
            "ok": max_abs_diff < 2e-2 and graph_matches,
            "graph_replay_matches_eager": graph_matches,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_decode_attention_gpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
