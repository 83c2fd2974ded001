"""A batch of questions over one shared few-shot prefix, run with ``run_batch``.

Every program in the batch starts with the same worked examples; only the last question differs.
The runtime computes the shared prefix once and serves every other program of the batch from its
radix cache, so the cache hit rate is high. The program prints each answer and the statistics.

    .venv/bin/python examples/few_shot_batch.py [--num-questions N] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import time

import radixlang as sgl

INSTRUCTIONS = (
    "Answer each question with one word or a short phrase. Use the same format as the examples."
)
EXAMPLES = [
    ("What is the opposite of cold?", "hot"),
    ("What color is the sky on a clear day?", "blue"),
    ("How many legs does a spider have?", "eight"),
    ("What do bees make?", "honey"),
    ("What is frozen water called?", "ice"),
    ("Which animal is known as the king of the jungle?", "the lion"),
]
QUESTIONS = [
    "What is the opposite of up?",
    "What color is grass?",
    "How many days are in a week?",
    "What do cows drink?",
    "What is the capital of France?",
    "Which planet do we live on?",
    "What do you call a baby dog?",
    "What is the opposite of day?",
    "How many wheels does a bicycle have?",
    "What fruit is yellow and curved?",
    "What do we use to write on a blackboard?",
    "Which season comes after winter?",
    "What is the largest ocean?",
    "How many hours are in a day?",
    "What gas do people breathe in to live?",
    "What is the color of snow?",
    "Which animal says moo?",
    "What is the opposite of full?",
    "What do fish live in?",
    "How many months are in a year?",
]


def few_shot_prefix() -> str:
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in EXAMPLES)
    return f"{INSTRUCTIONS}\n\n{shots}"


@sgl.function
def answer(s, question: str, max_tokens: int):
    s += few_shot_prefix()
    s += f"Q: {question}\nA:"
    s += sgl.gen("answer", max_tokens=max_tokens, stop=["\n"], temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per answer")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_questions)]
        start = time.perf_counter()
        states = answer.run_batch(
            [{"question": q, "max_tokens": args.max_tokens} for q in questions],
            progress_bar=True,
        )
        seconds = time.perf_counter() - start
        for q, state in zip(questions, states, strict=True):
            print(f"Q: {q}\n   A: {state['answer'].strip()}")
        prefix_len = len(rt.engine.tokenizer.encode(few_shot_prefix()))
        print(
            f"\n{len(states)} programs in {seconds:.1f} s; the shared few-shot prefix has "
            f"{prefix_len} tokens ({len(states) * prefix_len} if every program computed it)"
        )
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
