"""Tree-of-thought as a radixlang program: a plan grown as a tree of short thoughts, every leaf
judged, and a vote that picks the best path.

The root holds the problem. Each node forks into ``--branching`` children, and each child adds
one sampled thought (one step of the plan) to its parent's text, down to ``--depth`` steps: with
the defaults 3 and 3 that is 3 + 9 + 27 = 39 thoughts and 27 leaves. Every leaf then asks the
model whether its plan is good and selects "yes" or "no"; the probability of "yes" is the leaf's
score. The vote walks down from the root, at each level taking the child whose leaves voted "yes"
most often (ties by summed score).

Every prompt in the tree extends its parent's, so a prefix cache should compute each distinct
prompt token once. The program records the text of every prompt it sends, builds the token trie
of all of them, and prints its size (the distinct prompt tokens) next to the prompt tokens the
runtime computed. Tokens that a generation decoded are already in the cache when a child's prompt
repeats them, so it also counts the trie positions that lie on an earlier generation's output:
the trie size less those is the least prompt computation any prefix cache can do, and the
program prints the runtime's prompt tokens computed as a ratio to it (1.0 is optimal).

    .venv/bin/python examples/tree_of_thought.py [--branching N] [--depth N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import radixlang as sgl

SYSTEM = (
    "You are a practical planner. You write plans as numbered steps; each step is one short, "
    "concrete sentence that builds on the steps before it."
)
PROBLEM = (
    "A small public library wants more teenagers to visit it after school. Propose a plan, "
    "one step at a time."
)
JUDGE = "Is this plan realistic and likely to work? Answer yes or no."
VERDICTS = ["yes", "no"]


@dataclass
class Node:
    """One thought in the tree; the root has no thought."""

    depth: int
    state: Any = None
    thought: str = ""
    children: list[Node] = field(default_factory=list)
    verdict: str | None = None  # leaves only
    score: float = 0.0  # leaves: P(yes) between the two verdicts

    def leaves(self) -> list[Node]:
        return [self] if not self.children else [x for c in self.children for x in c.leaves()]


class PromptLog:
    """The text of every prompt the program sends, as the runtime will see it."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.generations: list[tuple[str, Any, str]] = []  # (prompt, state, variable)

    def before_fork(self, s) -> None:
        self.prompts.append(s.text())  # a fork prefills the shared prefix once, up front

    def before_gen(self, s, name: str) -> None:
        text = s.text()
        self.prompts.append(text)
        self.generations.append((text, s, name))

    def before_select(self, s, choices: list[str]) -> None:
        text = s.text()
        self.prompts.extend(text + choice for choice in choices)


@sgl.function
def grow_and_judge(
    s,
    root: Node,
    branching: int,
    depth: int,
    max_tokens: int,
    sample_temperature: float,
    log: PromptLog,
):
    s += sgl.system(SYSTEM)
    s += sgl.user(PROBLEM)
    s += sgl.assistant_begin()
    root.state = s
    frontier = [root]
    for d in range(1, depth + 1):
        next_frontier = []
        for node in frontier:
            # fork waits for this node's own thought; its siblings' keep decoding meanwhile.
            log.before_fork(node.state)
            for child_state in node.state.fork(branching):
                child = Node(depth=d, state=child_state)
                node.children.append(child)
                child_state += f"Step {d}:"
                log.before_gen(child_state, f"thought_{d}")
                child_state += sgl.gen(
                    f"thought_{d}",
                    max_tokens=max_tokens,
                    temperature=sample_temperature,
                    stop=["\n"],
                )
                child_state += "\n"
                next_frontier.append(child)
        frontier = next_frontier

    for leaf in frontier:
        leaf.state += sgl.assistant_end()
        leaf.state += sgl.user(JUDGE)
        leaf.state += sgl.assistant_begin()
        log.before_select(leaf.state, VERDICTS)
        leaf.state += sgl.select("verdict", choices=VERDICTS)


def read_results(node: Node) -> None:
    """Fill in each node's thought and each leaf's verdict and score from the finished states."""
    if node.depth:
        node.thought = " ".join(str(node.state[f"thought_{node.depth}"]).split())
    if not node.children:
        node.verdict = node.state["verdict"]
        logprobs = node.state.get_meta_info("verdict")["normalized_prompt_logprobs"]
        yes, no = (float(x) for x in logprobs[:2])
        node.score = 1.0 / (1.0 + math.exp(no - yes))
    for child in node.children:
        read_results(child)


def vote(root: Node) -> list[Node]:
    """The winning path: at each level the child whose leaves said "yes" most often."""

    def key(node: Node) -> tuple[int, float]:
        leaves = node.leaves()
        return sum(leaf.verdict == "yes" for leaf in leaves), sum(leaf.score for leaf in leaves)

    path, node = [], root
    while node.children:
        node = max(node.children, key=key)
        path.append(node)
    return path


def render(node: Node, winners: set[int], prefix: str = "") -> list[str]:
    lines = []
    for i, child in enumerate(node.children):
        last = i == len(node.children) - 1
        mark = "*" if id(child) in winners else " "
        text = f"Step {child.depth}: {child.thought[:70]}"
        if not child.children:
            text += f"   [{child.verdict}, P(yes)={child.score:.2f}]"
        lines.append(f"{prefix}{'└─' if last else '├─'}{mark}{text}")
        lines += render(child, winners, prefix + ("   " if last else "│  "))
    return lines


def prefill_bounds(encode, log: PromptLog) -> tuple[int, int]:
    """(distinct prompt tokens, those of them that an earlier generation decoded).

    The first is the size of the token trie of every prompt sent: the prompt tokens a perfect
    prefix cache computes when it keeps only what prompts computed. A generation's decoded tokens
    are in the cache too (their K/V was written while decoding), so the trie positions that lie on
    a generation's prompt + output path past its prompt never need a prefill: the difference is
    the least any prefix cache computes.
    """
    root: dict[int, dict] = {}
    distinct = 0
    for prompt in log.prompts:
        node = root
        for token in encode(prompt):
            if token not in node:
                node[token] = {}
                distinct += 1
            node = node[token]
    decoded: set[int] = set()
    for prompt, state, name in log.generations:
        prompt_ids = encode(prompt)
        output_ids = list(state.get_meta_info(name)["output_ids"])
        node = root
        # The last sampled token was never fed back, so its K/V was not computed.
        for depth, token in enumerate(prompt_ids + output_ids[:-1]):
            if token not in node:
                break
            node = node[token]
            if depth >= len(prompt_ids):
                decoded.add(id(node))
    return distinct, len(decoded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--branching", type=int, default=3, help="children per node")
    parser.add_argument("--depth", type=int, default=3, help="thoughts per path")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per thought")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        rt.flush_cache()
        before = rt.stats()["prompt_tokens_computed"]
        root, log = Node(depth=0), PromptLog()
        start = time.perf_counter()
        grow_and_judge.run(
            root=root,
            branching=args.branching,
            depth=args.depth,
            max_tokens=args.max_tokens,
            sample_temperature=args.temperature,
            log=log,
        )
        read_results(root)  # waits for every leaf's verdict (the leaves are never joined)
        seconds = time.perf_counter() - start
        computed = rt.stats()["prompt_tokens_computed"] - before

        path = vote(root)
        leaves = root.leaves()
        print(f"Problem: {PROBLEM}\n")
        print("\n".join(render(root, {id(n) for n in path})))
        yes = sum(leaf.verdict == "yes" for leaf in leaves)
        print(f"\n{len(leaves)} leaves, {yes} judged 'yes'; the vote's winner (marked *):")
        for node in path:
            print(f"  Step {node.depth}: {node.thought}")
        print(f"  score P(yes) = {path[-1].score:.2f}; done in {seconds:.1f} s\n")

        encode = rt.engine.tokenizer.encode
        sent = sum(len(encode(p)) for p in log.prompts)
        distinct, decoded = prefill_bounds(encode, log)
        least = distinct - decoded
        print(f"prompts sent: {len(log.prompts)} with {sent} tokens in all (no cache computes all)")
        print(f"distinct prompt tokens (token trie of all prompts): {distinct}")
        print(f"  of which an earlier generation decoded (cached as it was generated): {decoded}")
        print(f"least prompt computation with a perfect prefix cache: {least}")
        print(f"prompt tokens computed by the runtime: {computed}")
        print(
            f"computed / distinct = {computed / distinct:.2f}; "
            f"computed / least = {computed / max(least, 1):.2f}"
        )
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
