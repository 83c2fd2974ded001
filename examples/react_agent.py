"""A ReAct agent as a radixlang program: the model calls local tools (a safe calculator, a
search over a small document set, a unit converter) until it can answer.

Each step is one ``gen`` that may call tools (``gen(tools=...)``): a grammar holds the answer to
valid calls of them, or to text. ``run_tools`` runs the calls and appends their results as
tool turns; the next step reads them. The tools are described once, in the system message, so
every step, and every agent with the same system prompt, extends one shared prefix that the
radix cache computes once. Several questions run as concurrent agents, batched by the engine.

    .venv/bin/python examples/react_agent.py [--questions N] [--steps N] [--max-tokens N]
    radixlang run examples/react_agent.py -- --questions 2
"""

from __future__ import annotations

import argparse
import time

from agent_tools import TOOLS

import radixlang as sgl

SYSTEM = (
    "You are a research agent. First search the documents for the facts you need, then "
    "calculate or convert units with the tools, then answer the question in one sentence."
)
QUESTIONS = [
    "How tall is Mount Everest in feet?",
    "How much deeper is the Mariana Trench than Lake Baikal, in metres?",
    "How long is the Nile in miles?",
    "What is 17 * 23 + 4?",
]


@sgl.function
def react(s, question: str, max_steps: int, max_tokens: int):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    for step in range(max_steps):
        # The first step must use a tool (a small model would otherwise guess at once).
        choice = "required" if step == 0 else "auto"
        name = f"step_{step}"
        s += sgl.assistant(sgl.gen(name, tools=TOOLS, tool_choice=choice,
                                   max_tokens=max_tokens, temperature=0))  # fmt: skip
        s["steps"] = step + 1
        if not s.tool_calls(name):  # an answer in text: done
            s["answer"] = s[name]
            return
        s += sgl.run_tools(name, timeout=10)
    # Out of steps: answer from what the tools said, without tools.
    s += sgl.assistant(sgl.gen("final", max_tokens=max_tokens, temperature=0))
    s["answer"] = s["final"]


def trace(state) -> list[str]:
    """Each step's calls and what the tools answered, and the answer."""
    lines = []
    for step in range(state["steps"]):
        name = f"step_{step}"
        calls = state.tool_calls(name)
        if not calls:
            continue
        results = state.tool_results(name)
        for call, result in zip(calls, results, strict=True):
            arguments = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
            answer = " ".join(result.content.split())[:90]
            mark = "error" if result.is_error else f"{result.seconds * 1000:.1f} ms"
            lines.append(f"  step {step + 1}: {call.name}({arguments}) -> {answer}  [{mark}]")
    lines.append(f"  answer: {' '.join(state['answer'].split())}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=3, help="concurrent agents (up to 4)")
    parser.add_argument("--steps", type=int, default=3, help="tool steps per agent at most")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per step")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        questions = QUESTIONS[: max(1, min(args.questions, len(QUESTIONS)))]
        start = time.perf_counter()
        states = react.run_batch(
            [{"question": q, "max_steps": args.steps, "max_tokens": args.max_tokens}
             for q in questions]
        )  # fmt: skip
        seconds = time.perf_counter() - start
        for question, state in zip(questions, states, strict=True):
            print(f"Q: {question}")
            print("\n".join(trace(state)))
        calls = sum(len(s.tool_calls(f"step_{i}")) for s in states for i in range(s["steps"]))
        print(f"\n{len(states)} agents, {calls} tool calls, done in {seconds:.1f} s")
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
