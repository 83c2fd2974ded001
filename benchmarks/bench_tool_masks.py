"""Token-mask time of tool-call grammars: ``auto`` as it was (a call only at the start, free
text otherwise) against ``auto`` with text before a call (lazy: free until the marker), in the
Hermes/Qwen format with the marker as text and as a token of its own.

One command:  .venv/bin/python benchmarks/bench_tool_masks.py [--quick]

Each grammar walks the same outputs token by token (a reply of free text, then, where the
grammar allows text before calls, a call), timing llguidance's mask for every token; the
default model's tokenizer (49,152 tokens). Writes results/bench_tool_masks.json and .png:
microseconds per token for the text and for the call, per grammar, over ``--repeats`` walks
(median and spread).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from provenance import provenance

TEXT = (
    "Let me look that up for you. The forecast service knows the weather in most cities, so "
    "I will ask it for Paris in degrees Celsius and tell you what it says, with the days ahead "
    "if you want them. One moment while I check the latest readings."
)
TOOLS = [
    ("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}),
    ("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                  "required": ["zone"]}),
]  # fmt: skip
CALL = [("get_weather", {"city": "Paris", "unit": "c"})]


def _walk(grammar: Any, tokens: list[int]) -> list[float]:
    """Microseconds of each token's mask along ``tokens``."""
    constraint = grammar.new_constraint()
    times = []
    for token in tokens:
        start = time.perf_counter()
        constraint.allowed_mask()
        times.append((time.perf_counter() - start) * 1e6)
        constraint.advance(token)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats

    from transformers import AutoTokenizer

    from radixlang.constrain import compile_grammar
    from radixlang.constrain.tool_calls import call_grammar
    from radixlang.constrain.tool_formats import DEFAULT_FORMAT, HERMES, marker_tokens
    from radixlang.model_files import load_model_files

    files = load_model_files()
    plain = AutoTokenizer.from_pretrained(files.path)
    marked = AutoTokenizer.from_pretrained(files.path)
    marked.add_tokens(["<tool_call>", "</tool_call>"])
    hermes_tokens = dataclasses.replace(HERMES, special=marker_tokens(HERMES, marked))
    cases = {
        # name: (tokenizer, format, text before the call)
        "radixlang auto (call only first)": (plain, DEFAULT_FORMAT, False),
        "hermes auto, marker as text (lazy)": (plain, HERMES, True),
        "hermes auto, marker as a token (lazy)": (marked, hermes_tokens, True),
    }
    results: dict[str, Any] = {"repeats": repeats, "cases": {}}
    for name, (tokenizer, fmt, text_first) in cases.items():
        vocab = len(tokenizer)
        grammar = compile_grammar("grammar", call_grammar("auto", TOOLS, True, None, fmt),
                                  tokenizer, vocab, [tokenizer.eos_token_id])  # fmt: skip
        text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
        call_text = (fmt.text_before if text_first else "") + fmt.render(CALL)
        call_ids = tokenizer.encode(call_text, add_special_tokens=False)
        text_us, call_us = [], []
        for _ in range(repeats):
            # A reply of text alone, and a call (after the text where the format allows).
            text_us.append(statistics.mean(_walk(grammar, text_ids)))
            walked = _walk(grammar, (text_ids if text_first else []) + call_ids)
            call_us.append(statistics.mean(walked[len(text_ids) if text_first else 0 :]))
        results["cases"][name] = {
            "text_us_per_token": _spread(text_us),
            "call_us_per_token": _spread(call_us),
            "text_tokens": len(text_ids),
            "call_tokens": len(call_ids),
        }
        print(f"{name}: text {_spread(text_us)['median']:.1f} us/token, "
              f"call {_spread(call_us)['median']:.1f} us/token")  # fmt: skip
    results["provenance"] = provenance(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tool_masks.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, args.out / "bench_tool_masks.png")
    return results


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["cases"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for k, part in enumerate(("text", "call")):
        medians = [results["cases"][n][f"{part}_us_per_token"]["median"] for n in names]
        ax.bar([i + 0.4 * k for i in range(len(names))], medians, width=0.4, label=part)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=7)
    ax.set_ylabel("mask time, us per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
