"""The engine against transformers' ``generate``, side by side in one process.

One command:  .venv/bin/python benchmarks/bench_engine.py
Writes benchmarks/results/bench_engine.json and .png.

For each dtype (float32 and bfloat16 by default), on the default model:
(a) Throughput: 64 requests of 128-token prompts, 128 new tokens each, greedy (EOS ignored, so
    both sides generate exactly the same number of tokens). radixlang gets all requests at once
    and batches them continuously; transformers runs ``generate`` on padded batches of 8 and of
    32. Generated tokens per second of wall time, and radixlang's speedup over the better
    transformers setting (target: at least 3x).
(b) Time to first token of a request whose 1,000-token prefix is cached, against the same kind
    of request on a cold cache (target: at least 10x lower), alternating cold and hot requests.
(c) With ``--deterministic``: what deterministic inference costs. Tokens/s at batch 1, 8 and
    64 (the first 1, 8 or 64 of 64 requests of 128-token prompts, 64 new tokens each) and the
    time of a 1,000-token prefill, on an engine with ``deterministic=True`` against one without,
    the two alternating ``--det-repeats`` times. Also whether the first request's tokens are
    the same at every batch size (they must be with the mode).
The ratios are what to read: the machines are shared and noisy. transformers runs first, on
short-lived threads, then the engine, so that only one thread owns an OpenMP team at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime import Engine, resolve_dtype

T = TypeVar("T")


def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on a short-lived thread and return its result.

    The transformers side runs this way so that no long-lived thread but the engine's owns an
    OpenMP team: libgomp throttles its workers once two threads own one, which would slow
    whichever side ran second.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def load_transformers(path: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()


def transformers_generate(
    model: Any, prompts: list[list[int]], new_tokens: int, batch: int, device: str
) -> tuple[float, list[list[int]]]:
    """Seconds for ``generate`` over left-padded batches of ``batch`` prompts, and the outputs."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.full((len(group), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        outputs += out[:, width:].tolist()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def make_engine(
    files: Any, dtype: torch.dtype, args: argparse.Namespace, deterministic: bool = False
) -> Engine:
    return Engine(
        files,
        dtype=dtype,
        device=args.device,
        kv_memory=args.kv_memory,
        overlap=args.overlap,
        cuda_graphs=args.cuda_graphs,
        deterministic=deterministic,
    )


def engine_generate(
    engine: Engine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, [r.output_ids for r in results]


def bench_throughput(files: Any, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """transformers first, each setting on a short-lived thread, then the engine: so that no
    other thread's OpenMP team is alive while either side runs."""
    prompts = random_prompts(args.requests, args.prompt_tokens, files.config.vocab_size, seed=0)
    generated = args.requests * args.new_tokens
    result: dict[str, Any] = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    hf = in_thread(load_transformers, files.path, dtype, args.device)
    in_thread(transformers_generate, hf, prompts[:2], 2, 2, args.device)  # warm up
    outputs = {}
    for batch in args.hf_batches:
        seconds, outputs[batch] = in_thread(
            transformers_generate, hf, prompts, args.new_tokens, batch, args.device
        )
        result[f"transformers_b{batch}"] = {"seconds": seconds, "tokens_per_s": generated / seconds}
        print(
            f"  transformers b{batch}: {seconds:.1f} s, {generated / seconds:.1f} tok/s", flush=True
        )
    del hf
    engine = make_engine(files, dtype, args)
    result["overlap"], result["cuda_graphs"] = engine.overlap, engine.runner.cuda_graphs
    try:
        engine_generate(engine, prompts[:2], 2)  # warm up
        seconds, ours = engine_generate(engine, prompts, args.new_tokens)
        result["radixlang"] = {"seconds": seconds, "tokens_per_s": generated / seconds}
        print(f"  radixlang: {seconds:.1f} s, {generated / seconds:.1f} tok/s", flush=True)
        result["ttft"] = bench_ttft(engine, args, files.config.vocab_size)
        result["engine_stats"] = engine.stats()
    finally:
        engine.shutdown()
    for batch, theirs in outputs.items():
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        result[f"transformers_b{batch}"]["identical_outputs"] = same
        print(f"  transformers b{batch}: {same}/{len(prompts)} outputs identical to radixlang's")
    best = max(result[f"transformers_b{b}"]["tokens_per_s"] for b in args.hf_batches)
    result["speedup_vs_best_transformers"] = result["radixlang"]["tokens_per_s"] / best
    result["target_3x"] = result["speedup_vs_best_transformers"] >= 3
    return result


def bench_ttft(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    (prefix,) = random_prompts(1, args.prefix_tokens, vocab, seed=1)
    suffixes = random_prompts(2 * args.ttft_repeats + 1, args.suffix_tokens, vocab, seed=2)
    params = {"temperature": 0, "max_new_tokens": 1}

    def ttft(prompt: list[int]) -> float:
        result = engine.submit(prompt, params).result()
        assert result.time_to_first_token is not None
        return result.time_to_first_token

    engine.flush_cache()
    ttft(prefix + suffixes[-1])  # warm up
    cold, hot = [], []
    for i in range(args.ttft_repeats):
        engine.flush_cache()
        cold.append(ttft(prefix + suffixes[2 * i]))  # computes the prefix and caches it
        hot.append(ttft(prefix + suffixes[2 * i + 1]))  # reuses it
    ratio = statistics.median(cold) / statistics.median(hot)
    print(
        f"  TTFT cold {statistics.median(cold) * 1e3:.1f} ms, "
        f"hot {statistics.median(hot) * 1e3:.1f} ms ({ratio:.1f}x)",
        flush=True,
    )
    return {
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "cold_ms": [t * 1e3 for t in cold],
        "hot_ms": [t * 1e3 for t in hot],
        "median_cold_ms": statistics.median(cold) * 1e3,
        "median_hot_ms": statistics.median(hot) * 1e3,
        "cold_over_hot": ratio,
        "target_10x": ratio >= 10,
    }


DET_BATCHES = (1, 8, 64)
MODES = ("default", "deterministic")


def bench_deterministic(files: Any, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s at batch 1, 8 and 64 and a 1,000-token prefill, with and without the mode; one
    engine at a time (each on its own thread, shut down before the next starts)."""
    vocab = files.config.vocab_size
    prompts = random_prompts(max(DET_BATCHES), args.prompt_tokens, vocab, seed=3)
    (long_prompt,) = random_prompts(1, args.prefix_tokens, vocab, seed=4)
    new_tokens = args.det_new_tokens
    runs: dict[str, dict[str, list[float]]] = {
        mode: {**{f"b{b}": [] for b in DET_BATCHES}, "prefill_ms": []} for mode in MODES
    }
    first_outputs: dict[str, dict[int, list[int]]] = {mode: {} for mode in MODES}
    for repeat in range(args.det_repeats):
        for mode in MODES:
            engine = make_engine(files, dtype, args, deterministic=mode == "deterministic")
            try:
                engine_generate(engine, prompts[:2], 2)  # warm up
                for b in DET_BATCHES:
                    seconds, outputs = engine_generate(engine, prompts[:b], new_tokens)
                    runs[mode][f"b{b}"].append(b * new_tokens / seconds)
                    first_outputs[mode][b] = outputs[0]
                engine.flush_cache()
                start = time.perf_counter()
                engine.generate(long_prompt, {"temperature": 0, "max_new_tokens": 1})
                runs[mode]["prefill_ms"].append((time.perf_counter() - start) * 1e3)
            finally:
                engine.shutdown()
            line = ", ".join(f"b{b} {runs[mode][f'b{b}'][-1]:.1f} tok/s" for b in DET_BATCHES)
            print(f"  {mode} #{repeat + 1}: {line}, "
                  f"prefill {runs[mode]['prefill_ms'][-1]:.0f} ms", flush=True)  # fmt: skip
    result: dict[str, Any] = {"new_tokens": new_tokens, "repeats": args.det_repeats, "runs": runs}
    cost = {}
    for key in [f"b{b}" for b in DET_BATCHES]:
        fast, slow = statistics.median(runs["default"][key]), statistics.median(runs[MODES[1]][key])
        cost[key] = {"default_tok_s": fast, "deterministic_tok_s": slow, "slowdown": fast / slow}
    fast = statistics.median(runs["default"]["prefill_ms"])
    slow = statistics.median(runs["deterministic"]["prefill_ms"])
    cost["prefill"] = {"default_ms": fast, "deterministic_ms": slow, "slowdown": slow / fast}
    result["cost"] = cost
    # The first request's tokens at every batch size: one answer with the mode.
    result["first_request_same_at_every_batch"] = {
        mode: len({tuple(first_outputs[mode][b]) for b in DET_BATCHES}) == 1 for mode in MODES
    }
    for key, c in cost.items():
        print(f"  {key}: {c['slowdown']:.2f}x slower with the mode", flush=True)
    print(f"  first request same at every batch: {result['first_request_same_at_every_batch']}")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    with_det = all("deterministic" in run for run in runs)
    fig, axes = plt.subplots(1, 3 if with_det else 2, figsize=(16 if with_det else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    names = ["radixlang"] + [f"transformers_b{b}" for b in result["config"]["hf_batches"]]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        values = [run["throughput"][name]["tokens_per_s"] for run in runs]
        ax1.bar([i + j * width for i in range(len(runs))], values, width, label=name)
    ax1.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(runs))])
    ax1.set_xticklabels([run["dtype"] for run in runs])
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("(a) 64 requests x 128 new tokens")
    ax1.legend()
    for k, (key, label) in enumerate(
        [("median_cold_ms", "cold cache"), ("median_hot_ms", "cached prefix")]
    ):
        values = [run["ttft"][key] for run in runs]
        ax2.bar([i + k * 0.4 for i in range(len(runs))], values, 0.4, label=label)
    ax2.set_xticks([i + 0.2 for i in range(len(runs))])
    ax2.set_xticklabels([run["dtype"] for run in runs])
    ax2.set_yscale("log")
    ax2.set_ylabel("time to first token, ms (log)")
    ax2.set_title(f"(b) {result['config']['prefix_tokens']}-token prefix")
    ax2.legend()
    if with_det:
        ax3 = axes[2]
        keys = [f"b{b}" for b in DET_BATCHES] + ["prefill"]
        for j, run in enumerate(runs):
            values = [run["deterministic"]["cost"][k]["slowdown"] for k in keys]
            ax3.bar([i + j * 0.4 for i in range(len(keys))], values, 0.4, label=run["dtype"])
        ax3.axhline(1.0, color="grey", linewidth=0.8)
        ax3.set_xticks([i + 0.2 for i in range(len(keys))])
        ax3.set_xticklabels(["batch 1", "batch 8", "batch 64", "1k prefill"])
        ax3.set_ylabel("time with the mode / without")
        ax3.set_title("(c) the cost of deterministic=True")
        ax3.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--kv-memory", default="2GiB")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's overlapped scheduling (default: the engine's, on for CUDA)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps as CUDA graph replays (default: the engine's, on for CUDA)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="also measure deterministic inference's cost: batch 1/8/64 and a 1,000-token "
        "prefill with and without it",
    )
    parser.add_argument("--det-new-tokens", type=int, default=64)
    parser.add_argument("--det-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    files = load_model_files(args.model)
    result: dict[str, Any] = {
        "benchmark": "bench_engine",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
        },
        "model": files.name,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "provenance": provenance(argv),
        "runs": [],
    }
    for name in args.dtypes:
        print(f"{name}:", flush=True)
        throughput = bench_throughput(files, resolve_dtype(name), args)
        ttft = throughput.pop("ttft")
        stats = throughput.pop("engine_stats")
        run = {"dtype": name, "throughput": throughput, "ttft": ttft, "engine_stats": stats}
        if args.deterministic:
            print(f"{name}, deterministic inference's cost:", flush=True)
            run["deterministic"] = bench_deterministic(files, resolve_dtype(name), args)
        result["runs"].append(run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_engine.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out / "bench_engine.png")
    print(f"wrote {args.out / 'bench_engine.json'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
