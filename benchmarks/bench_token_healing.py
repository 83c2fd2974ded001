"""Token healing on and off: what it fixes, what it changes, what it costs.

One command:  .venv/bin/python benchmarks/bench_token_healing.py [--quick]
Writes benchmarks/results/bench_token_healing.json and .png.

Three sets of prompts on the default model (bfloat16, greedy, one batch per set and mode):

- ``cut``: prompts that end inside what would be one token (``"import numpy as n"``,
  ``"Visit https:"``, a trailing space): the case token healing exists for;
- ``boundary``: the same kind of prompts ending on a word (``"import numpy as"``): a healed
  prompt may still re-decide its last token here (``" as"`` starts ``" assert"``);
- ``chat``: questions through the chat template (the prompt ends in ``"assistant\\n"``),
  how programs and the OpenAI routes call the model.

Each prompt carries a regex the prompt plus its continuation should match (the expected word).
Reported per set and mode: the share of answers matching, how many outputs healing changed,
and the time per batch; overall the share of prompts whose last token was healed. The default
of ``token_healing`` is chosen from these figures (see the JSON's ``decision``).

``--quick``: a smoke test on a tiny random-weight model (accuracy meaningless there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.testing import write_tiny_chat_model

CUT: list[tuple[str, str]] = [
    ("The capital of France is ", r"is\s+Paris"),
    ("import numpy as n", r"as np\b"),
    ("Visit our website at https:", r"https://"),
    ('print("Hello, wor', r"Hello, world"),
    ("The Eiffel Tower is in Pa", r"in Paris"),
    ("def fibonacci(n):\n    if n <= 1:\n        ret", r"return n"),
    ("The largest planet in our solar system is Jup", r"Jupiter"),
    ("for i in ran", r"range\("),
    ("My favourite programming language is Pyth", r"Python"),
    ("The United States of Amer", r"America"),
    ("Water is made of hydrogen and oxy", r"oxygen"),
    ("The first president of the United States was George Wash", r"Washington"),
    ("from collections import default", r"defaultdict"),
    ("The sun rises in the ea", r"the east"),
    ("<html>\n<head>\n<ti", r"<title>"),
    ("Monday, Tuesday, Wednes", r"Wednesday"),
    ("January, February, Mar", r"March"),
    ("The quick brown fox jumps over the lazy ", r"lazy\s+dog"),
    ("To be or not to be, that is the ques", r"question"),
    ("SELECT * FROM users WHE", r"WHERE"),
    ("The chemical symbol for water is H", r"H2O|H₂O"),
    ("She opened the door and walked into the kitch", r"kitchen"),
    ("The opposite of hot is co", r"cold"),
    ("Once upon a ti", r"a time"),
]
BOUNDARY: list[tuple[str, str]] = [
    ("The capital of France is", r"is\s+Paris"),
    ("import numpy as", r"as\s+np\b"),
    ("The Eiffel Tower is in", r"in\s+Paris"),
    ("The largest planet in our solar system is", r"Jupiter"),
    ("for i in", r"in\s+range\("),
    ("The first president of the United States was", r"George Washington"),
    ("from collections import", r"import\s+\w"),
    ("The sun rises in the", r"the\s+east"),
    ("Monday, Tuesday,", r"Wednesday"),
    ("January, February,", r"March"),
    ("The quick brown fox jumps over the lazy", r"lazy\s+dog"),
    ("To be or not to be, that is the", r"the\s+question"),
    ("Water is made of hydrogen and", r"and\s+oxygen"),
    ("The opposite of hot is", r"is\s+cold"),
    ("Once upon a", r"a\s+time"),
    ("She opened the door and walked into the", r"the\s+\w"),
]
CHAT: list[tuple[str, str]] = [
    ("What is the capital of France? Answer in one word.", r"Paris"),
    ("What is the largest planet in our solar system?", r"Jupiter"),
    ("Who was the first president of the United States?", r"Washington"),
    ("What is the chemical symbol for gold?", r"Au"),
    ("In which direction does the sun rise?", r"[Ee]ast"),
    ("What comes after Tuesday?", r"Wednesday"),
    ("What is the opposite of hot?", r"[Cc]old"),
    ("What is 2 + 2?", r"4|four"),
]
SETS = ("cut", "boundary", "chat")


def prompt_sets(tokenizer: Any, quick: bool) -> dict[str, list[tuple[str, str]]]:
    chat = [
        (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            answer,
        )
        for q, answer in CHAT
    ]
    sets = {"cut": CUT, "boundary": BOUNDARY, "chat": chat}
    return {k: v[:4] for k, v in sets.items()} if quick else sets


def run_set(
    engine: Any, items: list[tuple[str, str]], heal: bool, max_new_tokens: int
) -> dict[str, Any]:
    prompts = [p for p, _ in items]
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "token_healing": heal}
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    texts = [r.text for r in results]
    correct = [
        bool(re.search(answer, prompt + text))
        for (prompt, answer), text in zip(items, texts, strict=True)
    ]
    return {
        "seconds": seconds,
        "accuracy": sum(correct) / len(items),
        "correct": correct,
        "texts": texts,
        "mean_ttft_s": statistics.mean(r.time_to_first_token or 0.0 for r in results),
    }


def healed_share(engine: Any, items: list[tuple[str, str]]) -> float:
    """The share of prompts whose last token token healing would back up."""
    from radixlang.runtime import admission

    healed = 0
    for prompt, _ in items:
        ids = list(engine.tokenizer.encode(prompt))
        healed += admission.token_healing(engine, ids)[1] is not None
    return healed / len(items)


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from radixlang.runtime import Engine

    files = load_model_files(model)
    engine = Engine(files, dtype=args.dtype, kv_memory=args.kv_memory, background=False)
    try:
        sets = prompt_sets(engine.tokenizer, args.quick)
        engine.generate(["warm up"], {"max_new_tokens": 2, "token_healing": True})
        out: dict[str, Any] = {}
        for name, items in sets.items():
            modes: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            for _ in range(args.repeats):
                for mode in ("off", "on"):
                    modes[mode].append(run_set(engine, items, mode == "on", args.max_new_tokens))
            off, on = modes["off"][0], modes["on"][0]
            changed = [i for i, (a, b) in enumerate(zip(off["texts"], on["texts"], strict=True))
                       if a != b]  # fmt: skip
            out[name] = {
                "prompts": len(items),
                "healed_share": healed_share(engine, items),
                "accuracy_off": off["accuracy"],
                "accuracy_on": on["accuracy"],
                "changed_outputs": len(changed),
                "fixed": sum(on["correct"][i] and not off["correct"][i] for i in changed),
                "broken": sum(off["correct"][i] and not on["correct"][i] for i in changed),
                "seconds_off": [m["seconds"] for m in modes["off"]],
                "seconds_on": [m["seconds"] for m in modes["on"]],
                "mean_ttft_s_off": statistics.median(m["mean_ttft_s"] for m in modes["off"]),
                "mean_ttft_s_on": statistics.median(m["mean_ttft_s"] for m in modes["on"]),
                "examples": [
                    {"prompt": items[i][0][-60:], "off": off["texts"][i], "on": on["texts"][i]}
                    for i in changed[:6]
                ],
            }
            r = out[name]
            print(
                f"  {name:8s} healed {100 * r['healed_share']:3.0f}%  accuracy off "
                f"{100 * r['accuracy_off']:3.0f}% on {100 * r['accuracy_on']:3.0f}%  changed "
                f"{r['changed_outputs']}/{r['prompts']} (fixed {r['fixed']}, broke "
                f"{r['broken']})  {statistics.median(r['seconds_off']):.2f} s vs "
                f"{statistics.median(r['seconds_on']):.2f} s",
                flush=True,
            )
    finally:
        engine.shutdown()
    return out


def decide(sets: dict[str, Any]) -> dict[str, Any]:
    """On by default only if it fixes cut prompts and breaks nothing anywhere."""
    fixed = sum(s["fixed"] for s in sets.values())
    broken = sum(s["broken"] for s in sets.values())
    chat_changed = sets["chat"]["changed_outputs"]
    on = fixed > 0 and broken == 0 and chat_changed == 0
    return {
        "fixed": fixed,
        "broken": broken,
        "chat_outputs_changed": chat_changed,
        "default_on": on,
        "rule": "on by default only if it fixes some answers, breaks none, and leaves chat "
        "outputs unchanged",
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = result["sets"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(SETS))
    for j, mode in enumerate(("off", "on")):
        vals = [100 * sets[s][f"accuracy_{mode}"] for s in SETS]
        bars = axes[0].bar([x + (j - 0.5) * 0.4 for x in xs], vals, 0.4, label=f"healing {mode}")
        axes[0].bar_label(bars, fmt="%.0f", fontsize=8)
        secs = [statistics.median(sets[s][f"seconds_{mode}"]) for s in SETS]
        bars = axes[1].bar([x + (j - 0.5) * 0.4 for x in xs], secs, 0.4, label=f"healing {mode}")
        axes[1].bar_label(bars, fmt="%.2f", fontsize=8)
    for ax, label in ((axes[0], "answers matching (%)"), (axes[1], "seconds per batch")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{s} ({sets[s]['prompts']})" for s in SETS])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    d = result["decision"]
    axes[0].set_title(f"fixed {d['fixed']}, broke {d['broken']}", fontsize=9)
    fig.suptitle(f"Token healing, {result['model']} {result['dtype']}, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=f"default {DEFAULT_MODEL}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--kv-memory", default="256MiB")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (str(write_tiny_chat_model(tmp)) if args.quick else DEFAULT_MODEL)
        print(f"{model} {args.dtype}, greedy, {args.max_new_tokens} new tokens:", flush=True)
        sets = run(args, model)
    result = {
        "benchmark": "bench_token_healing",
        "provenance": provenance(argv),
        "machine": {
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "model": load_model_files(model).name if not args.quick else "tiny-random",
        "dtype": args.dtype,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sets": sets,
        "decision": decide(sets),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_token_healing.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"decision: {result['decision']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
