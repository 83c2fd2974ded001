"""Quantized weights on the default model: speed and accuracy, side by side with float32 and
bfloat16.

One command:  .venv/bin/python benchmarks/bench_quantization.py
Writes benchmarks/results/bench_quantization.json and .png.

For each variant (float32, bfloat16, and int8 weights with float32 activations by default):
- accuracy: perplexity of a fixed English text (benchmarks/data/perplexity_text.txt, ~650
  tokens) and greedy agreement with float32: the same 8 prompts each continued for 48 greedy
  tokens; "agreement" is the share of tokens generated before the first divergence, "exact" the
  share of prompts whose continuation is identical;
- speed: a decode step at batch 1, 8 and 32 with 400-token contexts, and prefill tokens/s of a
  512-token prompt (medians, the variants measured alternately).
The machine is shared and noisy: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime import ModelRunner, SequenceInput

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
    "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of motion are",
    "import numpy as np\n\n# Compute the mean of a list\n",
]
VARIANTS = {  # name -> (dtype, quantization)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
}


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    table = list(range(-(-len(ids) // runner.block_size)))
    out = runner.forward([SequenceInput(ids, 0, table, return_logprobs=True)])
    logprobs = out.prompt_logprobs[0]
    assert logprobs is not None
    return math.exp(-float(logprobs.double().mean()))


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt continued greedily, all in one batch (the runner's forward, no engine)."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens + 1) // runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.forward(
        [SequenceInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    ).logits
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    for step in range(new_tokens):
        next_ids = logits.argmax(dim=-1).tolist()
        for row, token in enumerate(next_ids):
            outputs[row].append(token)
        if step == new_tokens - 1:
            break
        seqs = [
            SequenceInput([token], lengths[row] + step, tables[row])
            for row, token in enumerate(next_ids)
        ]
        logits = runner.forward(seqs).logits
    return outputs


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    prefix = []
    for want, got in zip(reference, other, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want)
        )
        prefix.append(same / len(want))
    exact = sum(a == b for a, b in zip(reference, other, strict=True)) / len(reference)
    return {"agreement": statistics.mean(prefix), "exact": exact}


def time_decode(runner: ModelRunner, batch: int, context: int, steps: int) -> list[float]:
    """Decode steps of ``batch`` rows over ``context`` cached tokens each: one context is
    computed, then its blocks are copied to the other rows (timing needs no distinct ones)."""
    per_seq = -(-(context + steps + 1) // runner.block_size)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    ids = torch.randint(runner.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    runner.forward([SequenceInput(ids.tolist(), 0, tables[0])])
    for b in range(1, batch):
        for src, dst in zip(tables[0], tables[b], strict=True):
            runner.copy_block(src, dst, runner.block_size)
    times = []
    for step in range(steps):
        seqs = [SequenceInput([7], context + step, tables[b]) for b in range(batch)]
        start = time.perf_counter()
        runner.forward(seqs)
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step warms up


def time_prefill(runner: ModelRunner, tokens: int, repeats: int) -> list[float]:
    ids = torch.randint(runner.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    table = list(range(-(-tokens // runner.block_size)))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runner.forward([SequenceInput(ids.tolist(), 0, table)])
        times.append(time.perf_counter() - start)
    return times[1:]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    rows = [result["variants"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    batches = result["config"]["batches"]
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * 0.25 for j in range(len(batches))]
        axes[0].bar(xs, [rows[i]["decode_ms"][str(b)] for b in batches], 0.25, label=name)
    axes[0].set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    axes[0].set_ylabel("decode step (ms)")
    axes[0].legend()
    axes[1].bar(names, [r["prefill_tokens_per_s"] for r in rows])
    axes[1].set_ylabel(f"prefill tokens/s ({result['config']['prefill_tokens']} tokens)")
    axes[2].bar(names, [r["perplexity"] for r in rows])
    for j, r in enumerate(rows):
        axes[2].text(j, r["perplexity"], f"agree {r['greedy']['agreement']:.0%}", ha="center")
    axes[2].set_ylabel("perplexity (fixed text)")
    fig.suptitle(f"{result['model']}: quantization, speed and accuracy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per batch")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--rounds", type=int, default=2, help="alternating timing rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    files = load_model_files(args.model)
    tokenizer = files.load_tokenizer()
    text_ids = tokenizer(TEXT.read_text()).input_ids
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    per_seq = -(-(max(args.context + args.steps + 1, args.prefill_tokens, len(text_ids))) // 16)
    num_blocks = max(max(args.batches), len(PROMPTS)) * per_seq
    runners = {
        name: ModelRunner(
            files, dtype=VARIANTS[name][0], quantization=VARIANTS[name][1], num_blocks=num_blocks
        )
        for name in args.variants
    }
    result: dict[str, Any] = {
        "benchmark": "bench_quantization",
        "provenance": provenance(argv),
        "model": files.name,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch_threads": torch.get_num_threads(),
        },
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "text_tokens": len(text_ids),
        "variants": {},
    }
    outputs = {name: greedy(r, prompt_ids, args.new_tokens) for name, r in runners.items()}
    reference = outputs.get("float32") or next(iter(outputs.values()))
    decode: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batches} for n in runners}
    prefill: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(args.rounds):  # alternate the variants so that noise hits them alike
        for name, runner in runners.items():
            for batch in args.batches:
                decode[name][batch] += time_decode(runner, batch, args.context, args.steps)
            prefill[name] += time_prefill(runner, args.prefill_tokens, 1)
    for name, runner in runners.items():
        row = {
            "dtype": VARIANTS[name][0],
            "quantization": VARIANTS[name][1],
            "weights_bytes": runner.model.num_parameter_bytes,
            "perplexity": perplexity(runner, text_ids),
            "greedy": agreement(reference, outputs[name]),
            "decode_ms": {str(b): statistics.median(t) * 1e3 for b, t in decode[name].items()},
            "decode_ms_spread": {
                str(b): [min(t) * 1e3, max(t) * 1e3] for b, t in decode[name].items()
            },
            "prefill_tokens_per_s": args.prefill_tokens / statistics.median(prefill[name]),
            "sample_continuation": tokenizer.decode(outputs[name][0]),
        }
        result["variants"][name] = row
        print(
            f"{name:9s} ppl {row['perplexity']:7.3f}  greedy agreement "
            f"{row['greedy']['agreement']:.0%} (exact {row['greedy']['exact']:.0%})  decode ms "
            + " ".join(f"b{b}={row['decode_ms'][str(b)]:.1f}" for b in args.batches)
            + f"  prefill {row['prefill_tokens_per_s']:.0f} tok/s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quantization.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_quantization.png")
    print(f"wrote {args.out / 'bench_quantization.json'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
