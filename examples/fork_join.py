"""Skeleton-of-thought as a radixlang program: first a short outline, then every point of it
expanded in parallel, then the pieces assembled into one answer.

The outline is a numbered list of tip titles, one generation per line. The state then forks into
one branch per tip; each branch asks for that tip's explanation, and all branches decode together
in one batch. Every branch starts from the same conversation, which the runtime computed once and
shares from its radix cache. ``join`` gathers the branches' results back into the parent.

    .venv/bin/python examples/fork_join.py [--tips N] [--max-tokens N] [--topic TEXT]
"""

from __future__ import annotations

import argparse
import time

import radixlang as sgl

SYSTEM = "You are a practical coach. You write short, concrete advice."


@sgl.function
def tips(s, topic: str, num_tips: int, max_tokens: int):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Give {num_tips} tips for {topic}. Only the tip titles, one per line.")
    with s.assistant():  # the outline: one short generation per numbered line
        for i in range(num_tips):
            s += f"Tip {i + 1}:" + sgl.gen(f"title_{i}", max_tokens=16, stop=["\n"], temperature=0)
            s += "\n"

    titles = [s[f"title_{i}"].strip() for i in range(num_tips)]
    branches = s.fork(num_tips)
    for title, branch in zip(titles, branches, strict=True):
        branch += sgl.user(
            f'Explain the tip "{title}" in two sentences: why it helps and how to start today.'
        )
        branch += sgl.assistant(sgl.gen("detail", max_tokens=max_tokens, temperature=0))
    branches.join()


def assemble(state, num_tips: int) -> str:
    """The final answer: each tip's title followed by its branch's explanation."""
    details = state["detail"]
    parts = []
    for i in range(num_tips):
        title = state[f"title_{i}"].strip().strip("*").strip()
        parts.append(f"{i + 1}. {title}\n   {' '.join(details[i].split())}")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default="staying focused while working from home")
    parser.add_argument("--tips", type=int, default=4, help="outline points (= branches)")
    parser.add_argument("--max-tokens", type=int, default=80, help="tokens per expanded tip")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        start = time.perf_counter()
        state = tips.run(topic=args.topic, num_tips=args.tips, max_tokens=args.max_tokens)
        seconds = time.perf_counter() - start
        print(f"Tips for {args.topic}:\n")
        print(assemble(state, args.tips))
        print(f"\n{args.tips} branches expanded in parallel; done in {seconds:.1f} s")
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
