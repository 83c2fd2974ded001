"""A multi-turn chat as a radixlang program: one system prompt, several user turns, each answered
by a generation inside the assistant's turn.

Every turn's prompt extends the previous turn's prompt and reply, so the runtime computes only the
new user message: the rest of the conversation comes from the radix cache. A second chat with the
same system prompt reuses that too. The program prints the conversation (``messages()``) and the
cache statistics.

    .venv/bin/python examples/multi_turn.py [--max-tokens N] [--turns N] [--model NAME_OR_PATH]
"""

from __future__ import annotations

import argparse
import time

import radixlang as sgl

SYSTEM = (
    "You are a patient cooking teacher. Answer in two or three short sentences and stay on the "
    "topic of the conversation."
)
CHATS = [
    [
        "I want to bake bread at home for the first time. What do I need?",
        "How long should the dough rise?",
        "How do I know when the loaf is done?",
        "What is a good first variation to try next week?",
    ],
    [
        "How do I cook rice so that it is not sticky?",
        "Can I use the same method for brown rice?",
        "What should I serve it with?",
        "How long does cooked rice keep in the fridge?",
    ],
]


@sgl.function
def chat(s, questions: list[str], max_tokens: int):
    s += sgl.system(SYSTEM)
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens, temperature=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per reply")
    parser.add_argument("--turns", type=int, default=3, help="user turns per chat (at least 1)")
    parser.add_argument("--chats", type=int, default=2, help="how many chats to run (1 or 2)")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        start = time.perf_counter()
        for questions in CHATS[: args.chats]:
            state = chat.run(questions=questions[: args.turns], max_tokens=args.max_tokens)
            for message in state.messages():
                print(f"[{message['role']}] {message['content'].strip()}")
            print()
        print(f"done in {time.perf_counter() - start:.1f} s")
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
