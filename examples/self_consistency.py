"""Self-consistency as a radixlang program: sample several short chains of reasoning for one
question, read a final integer answer from each, and take the majority vote.

The question's prompt is written once; the state then forks into N branches that sample at a
temperature above zero. The runtime computes the shared prompt once and every branch reuses it
from the radix cache, so the prompt tokens computed for the whole program are about the prompt's
length plus each branch's own few tokens, not N times the prompt. The program prints the votes,
the winner, and that comparison.

    .venv/bin/python examples/self_consistency.py [--samples N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import radixlang as sgl

SYSTEM = (
    "You are a careful math tutor. You solve word problems step by step: you write down the "
    "quantities you are given, combine them one operation at a time, check the result, and "
    "finish with a line of the form 'Answer: <number>'. Keep the reasoning to a few short lines."
)
QUESTION = (
    "Tom has 3 boxes of pencils with 4 pencils in each box. He gives 2 pencils to his sister. "
    "How many pencils does Tom have now?"
)


@sgl.function
def solve(s, question: str, samples: int, max_tokens: int, sample_temperature: float, seen: list):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant_begin()
    seen.append(s.text())  # the shared prompt, for the cache check below
    branches = s.fork(samples)
    for branch in branches:
        branch += sgl.gen(
            "reasoning", max_tokens=max_tokens, temperature=sample_temperature, stop=["Answer"]
        )
        branch += "\nAnswer: " + sgl.gen_int("answer", max_tokens=6, temperature=0)
    branches.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="reasoning chains (branches)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per reasoning chain")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        rt.flush_cache()
        before = rt.stats()["prompt_tokens_computed"]
        seen: list[str] = []
        start = time.perf_counter()
        state = solve.run(
            question=QUESTION,
            samples=args.samples,
            max_tokens=args.max_tokens,
            sample_temperature=args.temperature,
            seen=seen,
        )
        seconds = time.perf_counter() - start
        computed = rt.stats()["prompt_tokens_computed"] - before

        print(f"Question: {QUESTION}\n")
        answers = [str(a).strip() for a in state["answer"]]
        for i, (reasoning, answer) in enumerate(zip(state["reasoning"], answers, strict=True)):
            print(f"sample {i}: answer {answer:>6}   | {' '.join(reasoning.split())[:100]}")
        votes = Counter(answers)
        winner, count = votes.most_common(1)[0]
        print(f"\nvotes: {dict(votes.most_common())}")
        print(f"winner: {winner} ({count} of {len(answers)} votes); done in {seconds:.1f} s\n")

        prompt_len = len(rt.engine.tokenizer.encode(seen[0]))
        print(
            f"question prompt: {prompt_len} tokens; prompt tokens computed by the program: "
            f"{computed} (without prefix sharing: at least {args.samples * prompt_len})"
        )
        once = prompt_len <= computed < 2 * prompt_len
        print(f"prompt computed once: {'yes' if once else 'NO'}")
        print(rt.cache_summary())
    finally:
        rt.shutdown()
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
