"""FlashInfer's paged attention against the project's Triton kernels, decode and extend, on a GPU.

One command:  .venv/bin/python benchmarks/bench_attention_backends.py
Writes benchmarks/results/bench_attention_backends.json and .png and prints the JSON.

Shape: the default model's attention (``--model``; its config gives the query heads, KV heads
and head_dim; SmolLM2-135M: 9, 3, 64), bfloat16, block (page) size 16.

- **decode**: ``triton_decode_attention.decode_attention`` against FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` (planned once per shape, then run), one query token per
  sequence over ``--contexts`` cached tokens, at ``--batches`` sequences. Combinations whose
  K/V exceed ``--max-kv-gib`` (or half the free GPU memory) are skipped.
- **extend**: ``triton_extend_attention.extend_attention`` against FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper``, causal, for ``--extend-cases`` given as
  ``BATCHxNEW+PREFIX`` (new tokens per sequence after a cached prefix).

Layouts: the project keeps K and V as two ``[num_blocks, block_size, kv_heads, head_dim]``
tensors, which is FlashInfer's ``NHD`` layout passed as a ``(k_cache, v_cache)`` tuple, so both
backends read the very same tensors; a block-table row becomes FlashInfer's ``indptr`` /
``indices`` / ``last_page_len``. The project's extend reads the new tokens' K/V from packed
``k_new``/``v_new`` and only the prefix from the cache; FlashInfer's paged prefill reads all of
it from the pages, so the cache holds prefix and new tokens and ``k_new``/``v_new`` are copies of
the new tokens' slots (same values for both).

Timing follows bench_decode_attention_gpu.py: warm-up, then CUDA events around every call with
the L2 flushed before each, median of ``--iters``. Each call is captured in a CUDA graph and the
graph replayed (kernel time without Python launch overhead); the eager times are reported too,
and a case whose call does not capture on one side is compared on eager times. Both outputs must
agree (allclose at bfloat16 tolerance); the max abs difference is recorded.

Without a CUDA GPU or without an importable ``flashinfer`` nothing is timed: the JSON says
``"skipped": "<reason>"`` and the command exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from provenance import provenance

from radixlang.kernels.layout import PagedKV

DTYPE = torch.bfloat16
# SmolLM2-135M's attention, used when the default model is not installed (the GPU machine
# carries only the code, not the model's weights).
FALLBACK_SHAPE = {"heads": 9, "kv_heads": 3, "head_dim": 64}
ATOL = RTOL = 2e-2  # bfloat16 outputs of two float32-accumulating kernels
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended workspace
SPARE_BLOCKS = 16  # pool blocks no sequence uses, so block ids are not simply 0..n-1
DEVICE = "cuda"  # one name, so the case builders can be dry-run on CPU tensors


def extend_case(spec: str) -> tuple[int, int, int]:
    """``BATCHxNEW+PREFIX`` (``8x256+0``) as ``(batch, new_tokens, prefix_tokens)``."""
    try:
        batch, rest = spec.lower().split("x")
        new, prefix = rest.split("+")
        case = int(batch), int(new), int(prefix)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxNEW+PREFIX, got {spec!r}") from None
    if case[0] < 1 or case[1] < 1 or case[2] < 0:
        raise argparse.ArgumentTypeError(f"batch, new tokens >= 1 and prefix >= 0: {spec!r}")
    return case


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from radixlang.model_files import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model whose attention shape is used")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument(
        "--extend-cases",
        type=extend_case,
        nargs="+",
        default=[extend_case(s) for s in ("1x1000+0", "1x1000+1000", "8x256+0")],
        metavar="BATCHxNEW+PREFIX",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-kv-gib", type=float, default=8.0, help="skip cases whose K/V exceed it")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p.parse_args(argv)


def attention_shape(model: str) -> dict[str, Any]:
    """Query heads, KV heads and head_dim of ``model``, or SmolLM2-135M's where it is absent."""
    from radixlang.model_files import load_model_files

    try:
        config = load_model_files(model).config
    except Exception as exc:  # not installed here: the shape is still worth measuring
        return {**FALLBACK_SHAPE, "source": f"fallback (SmolLM2-135M): {model}: {exc}"}
    # ModelConfig.head_dim is config.json's head_dim, else hidden_size // heads.
    return {
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "source": model,
    }


def skip_reason() -> str | None:
    """Why nothing can be timed here, or None."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append(f"no CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() False)")
    # find_spec first: it neither imports the package nor touches a GPU.
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append("flashinfer is not installed (no module named 'flashinfer')")
    elif not reasons:
        try:
            importlib.import_module("flashinfer")
        except Exception as exc:
            reasons.append(f"flashinfer is not importable: {type(exc).__name__}: {exc}")
    return "; ".join(reasons) or None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for name in ("triton", "flashinfer"):
        if name == "flashinfer" and "flashinfer" not in sys.modules:
            continue  # importing it only to read a version could fail or take seconds
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception:
            info[name] = None
    return info


# ----------------------------------------------------------------- inputs (any device)


def paged_batch(
    lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    gen: torch.Generator,
    device: str | torch.device,
    dtype: torch.dtype = DTYPE,
) -> tuple[PagedKV, torch.Tensor]:
    """A random K/V pool holding sequences of ``lens`` tokens in randomly ordered blocks, and
    their ``[batch, max_blocks]`` int32 block tables (padding entries are 0, never read)."""
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + SPARE_BLOCKS
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = PagedKV(
        torch.randn(shape, generator=gen, device=device, dtype=dtype),
        torch.randn(shape, generator=gen, device=device, dtype=dtype),
    )
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(counts):
        tables[row, :count] = order[start : start + count]
        start += count
    return cache, tables


def flashinfer_page_table(
    block_tables: torch.Tensor, lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr, indices, last_page_len)`` (int32) for FlashInfer from the project's padded
    block-table rows and the sequences' token counts (each at least 1)."""
    if bool((lens < 1).any()):
        raise ValueError("FlashInfer's page table needs at least one token per sequence")
    pages = (lens + page_size - 1) // page_size
    used = torch.arange(block_tables.shape[1], device=lens.device) < pages[:, None]
    indices = block_tables[used]  # row-major: each sequence's pages, in order, back to back
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = lens - (pages - 1) * page_size
    return indptr, indices.to(torch.int32), last_page_len.to(torch.int32)


def token_slots(
    block_tables: torch.Tensor, starts: list[int], ends: list[int], bs: int
) -> torch.Tensor:
    """Cache slots of positions ``starts[i]..ends[i]-1`` of every row, packed row after row."""
    slots = []
    for row, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        pos = torch.arange(lo, hi, device=block_tables.device)
        slots.append(block_tables[row, pos // bs].long() * bs + pos % bs)
    return torch.cat(slots)


def extend_inputs(
    batch: int,
    new: int,
    prefix: int,
    shape: dict[str, Any],
    block_size: int,
    gen: torch.Generator,
    device: str | torch.device,
    dtype: torch.dtype = DTYPE,
) -> dict[str, Any]:
    """An extend batch whose cache already holds every token (prefix and new), as FlashInfer's
    paged prefill reads them; ``k_new``/``v_new`` copy the new tokens' slots for the project's
    kernel, which reads the new tokens from them."""
    kvh, dim = shape["kv_heads"], shape["head_dim"]
    cache, tables = paged_batch([prefix + new] * batch, block_size, kvh, dim, gen, device, dtype)
    slots = token_slots(tables, [prefix] * batch, [prefix + new] * batch, block_size)
    return {
        "q": torch.randn(
            batch * new, shape["heads"], dim, generator=gen, device=device, dtype=dtype
        ),
        "k_new": cache.k.view(-1, kvh, dim)[slots],
        "v_new": cache.v.view(-1, kvh, dim)[slots],
        "cache": cache,
        "block_tables": tables,
        "prefix_lens": torch.full((batch,), prefix, dtype=torch.int32, device=device),
        "extend_lens": torch.full((batch,), new, dtype=torch.int32, device=device),
        "host_lens": ([prefix] * batch, [new] * batch),
        "kv_lens": torch.full((batch,), prefix + new, dtype=torch.int32, device=device),
        "qo_indptr": torch.arange(batch + 1, dtype=torch.int32, device=device) * new,
    }


def flashinfer_kv(cache: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The project's cache as FlashInfer's NHD paged cache: the same two tensors, no copy."""
    # NHD: [max_num_pages, page_size, num_kv_heads, head_dim], what layout.py stores.
    if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        raise ValueError("FlashInfer reads contiguous K/V pages")
    return cache.k, cache.v


LAYOUT = {
    "radixlang": "K and V: two [num_blocks, block_size, kv_heads, head_dim] tensors",
    "flashinfer": "kv_layout='NHD', paged_kv_cache=(k_cache, v_cache) "
    "[max_num_pages, page_size, num_kv_heads, head_dim]",
    "copy_needed": False,
    "page_table": "block_tables rows -> indptr (cumulative pages), indices (the rows' used "
    "entries, in order), last_page_len (tokens in each last page, 1..page_size)",
}


# ----------------------------------------------------------------- timing (CUDA)


def us(times_ms: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(times_ms) * 1e3, 2),
        "min_us": round(min(times_ms) * 1e3, 2),
    }


def time_backend(fn: Callable[[], torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """Output, eager timing and CUDA-graph timing (or why it did not capture) of ``fn``."""
    from bench_decode_attention_gpu import time_calls

    out = fn()  # compiles / JIT-loads the kernels
    torch.cuda.synchronize()
    result: dict[str, Any] = {"out": out, "eager": us(time_calls(fn, args.warmup, args.iters))}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # a call that syncs or allocates on the host cannot be captured
        torch.cuda.synchronize()
        result["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result["graph_matches_eager"] = torch.equal(graph_out, out)
    result["graph"] = us(time_calls(graph.replay, args.warmup, args.iters))
    return result


def compare(triton: dict[str, Any], flashinfer: dict[str, Any]) -> dict[str, Any]:
    """The case's verdict: graph times where both captured, else eager times."""
    both_graphs = "graph" in triton and "graph" in flashinfer
    timing = "graph" if both_graphs else "eager"
    t_us, f_us = triton[timing]["median_us"], flashinfer[timing]["median_us"]
    got, want = triton["out"].float(), flashinfer["out"].float()
    return {
        "triton_us": t_us,
        "flashinfer_us": f_us,
        "timing": "cuda_graph_replay" if both_graphs else "eager",
        "ratio_triton_over_flashinfer": round(t_us / f_us, 3),
        "faster": "triton" if t_us < f_us else "flashinfer",
        "agreement": {
            "allclose": torch.allclose(got, want, atol=ATOL, rtol=RTOL),
            "max_abs_diff": (got - want).abs().max().item(),
            "atol": ATOL,
            "rtol": RTOL,
        },
        "details": {
            name: {k: v for k, v in side.items() if k != "out"}
            for name, side in (("triton", triton), ("flashinfer", flashinfer))
        },
    }


def kv_budget_bytes(args: argparse.Namespace) -> int:
    free, _ = torch.cuda.mem_get_info()
    return int(min(args.max_kv_gib * (1 << 30), free // 2))


def resolved_backend(wrapper: Any) -> str | None:
    try:
        return str(wrapper.resolved_backend)  # newer FlashInfer only
    except Exception:
        return None


def decode_case(
    batch: int,
    context: int,
    shape: dict[str, Any],
    args: argparse.Namespace,
    workspace: torch.Tensor,
    gen: torch.Generator,
) -> dict[str, Any]:
    import flashinfer

    triton_decode = importlib.import_module("radixlang.kernels.triton_decode_attention")
    heads, kvh, dim, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], args.block_size
    cache, tables = paged_batch([context] * batch, bs, kvh, dim, gen, DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, heads, dim, generator=gen, device=DEVICE, dtype=DTYPE)
    scale = dim**-0.5
    indptr, indices, last_page_len = flashinfer_page_table(tables, seq_lens, bs)
    kv = flashinfer_kv(cache)

    def run_triton() -> torch.Tensor:
        return triton_decode.decode_attention(q, cache, tables, seq_lens, scale)

    triton = time_backend(run_triton, args)
    # CUDA-core decode first (FlashInfer's default); the tensor-core path if that refuses the
    # GQA group size (9 / 3 = 3 on the default model).
    errors = []
    for tensor_cores in (False, True):
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores
            )
            wrapper.plan(
                indptr,
                indices,
                last_page_len,
                heads,
                kvh,
                dim,
                bs,
                q_data_type=DTYPE,
                kv_data_type=DTYPE,
                sm_scale=scale,
            )
            fi = time_backend(lambda w=wrapper: w.run(q, kv), args)
        except Exception as exc:
            errors.append(f"use_tensor_cores={tensor_cores}: {type(exc).__name__}: {exc}"[:400])
            continue
        fi["use_tensor_cores"] = tensor_cores
        fi["resolved_backend"] = resolved_backend(wrapper)
        if errors:
            fi["errors_before"] = errors
        return compare(triton, fi)
    return {"error": "flashinfer decode failed", "flashinfer_errors": errors}


def extend_case_run(
    batch: int,
    new: int,
    prefix: int,
    shape: dict[str, Any],
    args: argparse.Namespace,
    workspace: torch.Tensor,
    gen: torch.Generator,
) -> dict[str, Any]:
    import flashinfer

    triton_extend = importlib.import_module("radixlang.kernels.triton_extend_attention")
    heads, kvh, dim, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], args.block_size
    x = extend_inputs(batch, new, prefix, shape, bs, gen, DEVICE)
    scale = dim**-0.5
    indptr, indices, last_page_len = flashinfer_page_table(x["block_tables"], x["kv_lens"], bs)
    kv = flashinfer_kv(x["cache"])

    def run_triton() -> torch.Tensor:
        return triton_extend.extend_attention(
            x["q"],
            x["k_new"],
            x["v_new"],
            x["cache"],
            x["block_tables"],
            x["prefix_lens"],
            x["extend_lens"],
            scale,
            host_lens=x["host_lens"],  # no device->host read, so the call can be captured
        )

    triton = time_backend(run_triton, args)
    try:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        # causal aligns the new tokens with the end of each sequence's pages: new token i
        # sees the prefix and new tokens 0..i, as the project's extend does.
        wrapper.plan(
            x["qo_indptr"],
            indptr,
            indices,
            last_page_len,
            heads,
            kvh,
            dim,
            bs,
            causal=True,
            sm_scale=scale,
            q_data_type=DTYPE,
            kv_data_type=DTYPE,
        )
        fi = time_backend(lambda: wrapper.run(x["q"], kv), args)
    except Exception as exc:
        return {"error": f"flashinfer prefill failed: {type(exc).__name__}: {exc}"[:400]}
    fi["resolved_backend"] = resolved_backend(wrapper)
    return compare(triton, fi)


def phase_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [c for c in cases if "ratio_triton_over_flashinfer" in c]
    counts = {
        "timed_cases": len(timed),
        "failed_cases": sum("error" in c for c in cases),
        "skipped_cases": sum("skipped" in c for c in cases),
    }
    if not timed:
        return {"faster": None, **counts}
    ratios = [c["ratio_triton_over_flashinfer"] for c in timed]
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    return {
        # > 1: FlashInfer takes less time on the typical case.
        "geomean_ratio_triton_over_flashinfer": round(geomean, 3),
        "faster": "flashinfer" if geomean > 1 else "triton",
        "wins": {b: sum(c["faster"] == b for c in timed) for b in ("triton", "flashinfer")},
        **counts,
        "all_agree": all(c["agreement"]["allclose"] for c in timed),
    }


def run_cases(
    shape: dict[str, Any],
    args: argparse.Namespace,
    save: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """Every case in order; ``save`` gets the finished ones after each (a run killed by a
    timeout, say while FlashInfer JIT-compiles, still leaves them)."""
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
    budget = kv_budget_bytes(args)
    token_bytes = shape["kv_heads"] * shape["head_dim"] * 2 * DTYPE.itemsize  # K and V
    common = (shape, args, workspace, gen)
    work: list[tuple[dict[str, Any], int, Callable[[], dict[str, Any]]]] = []
    for context in args.contexts:
        for batch in args.batches:
            case = {"phase": "decode", "batch": batch, "context": context}
            work.append((case, batch * context, partial(decode_case, batch, context, *common)))
    for batch, new, prefix in args.extend_cases:
        case = {"phase": "extend", "batch": batch, "new_tokens": new, "prefix_tokens": prefix}
        run = partial(extend_case_run, batch, new, prefix, *common)
        work.append((case, batch * (prefix + new), run))
    for done, (case, tokens, run) in enumerate(work):
        save([c for c, _, _ in work[:done]])
        case["kv_bytes"] = tokens * token_bytes
        if case["kv_bytes"] > budget:
            mib = case["kv_bytes"] / 2**20
            case["skipped"] = f"K/V of {mib:.1f} MiB over the {budget / 2**20:.1f} MiB budget"
            continue
        print(f"{case} ...", file=sys.stderr, flush=True)
        try:
            case.update(run())
        except Exception as exc:  # one failing case should not lose the others
            case["error"] = f"{type(exc).__name__}: {exc}"[:400]
        torch.cuda.empty_cache()
    return [case for case, _, _ in work]


# ----------------------------------------------------------------- output


def plot(result: dict[str, Any], path: Path) -> str:
    """Write the figure; returns what was done (the GPU machine may lack matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return "not written: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "skipped" in result:
        fig, ax = plt.subplots(figsize=(8, 2.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "skipped: " + result["skipped"], ha="center", va="center", wrap=True)
        fig.savefig(path)
        plt.close(fig)
        return "placeholder (skipped)"
    cases = [c for c in result["cases"] if "triton_us" in c]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    decode = [c for c in cases if c["phase"] == "decode"]
    for i, context in enumerate(sorted({c["context"] for c in decode})):
        rows = sorted((c for c in decode if c["context"] == context), key=lambda c: c["batch"])
        batches = [c["batch"] for c in rows]
        color = f"C{i}"
        left.plot(batches, [c["triton_us"] for c in rows], "o-", color=color,
                  label=f"Triton, context {context}")  # fmt: skip
        left.plot(batches, [c["flashinfer_us"] for c in rows], "s--", color=color,
                  label=f"FlashInfer, context {context}")  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("batch (sequences)")
    left.set_ylabel("median µs per call")
    summary = result["summary"]
    left.set_title(f"decode: faster overall {summary['decode'].get('faster')}")
    left.legend(fontsize=7)
    extend = [c for c in cases if c["phase"] == "extend"]
    labels = [f"{c['batch']}x{c['new_tokens']}+{c['prefix_tokens']}" for c in extend]
    xs = range(len(extend))
    right.bar([x - 0.2 for x in xs], [c["triton_us"] for c in extend], 0.4, label="Triton")
    right.bar([x + 0.2 for x in xs], [c["flashinfer_us"] for c in extend], 0.4, label="FlashInfer")
    right.set_xticks(list(xs), labels)
    right.set_xlabel("batch x new tokens + cached prefix")
    right.set_ylabel("median µs per call")
    right.set_title(f"extend (causal): faster overall {summary['extend'].get('faster')}")
    right.legend()
    sh = result["shape"]
    title = f"{sh['heads']} heads / {sh['kv_heads']} KV heads, head_dim {sh['head_dim']}, bf16"
    fig.suptitle(f"{result['machine'].get('device')}: {title}, page {sh['page_size']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "written"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = attention_shape(args.model)
    reason = skip_reason()
    result: dict[str, Any] = {
        "benchmark": "bench_attention_backends",
        "machine": machine_info(),
        "provenance": provenance(argv),
        "shape": {
            **shape,
            "dtype": str(DTYPE).removeprefix("torch."),
            "page_size": args.block_size,
        },
        "layout": LAYOUT,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_attention_backends.json"
    if reason is not None:
        result["skipped"] = reason
        print(f"bench_attention_backends skipped: {reason}", file=sys.stderr)
    else:

        def save_partial(cases: list[dict[str, Any]]) -> None:
            partial_result = {**result, "partial": "cases finished so far", "cases": cases}
            path.write_text(json.dumps(partial_result, indent=2) + "\n")

        cases = run_cases(shape, args, save_partial)
        result["cases"] = cases
        result["summary"] = {
            phase: phase_summary([c for c in cases if c["phase"] == phase])
            for phase in ("decode", "extend")
        }
        result["faster_backend_per_phase"] = {p: s["faster"] for p, s in result["summary"].items()}
    result["plot"] = plot(result, path.with_suffix(".png"))
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
