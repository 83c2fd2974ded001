"""A planner and its workers as one radixlang program: the planner splits a task into
sub-questions (JSON under a schema), forks one worker per sub-question, each worker uses tools
(search, calculator, unit converter) in its own branch, and the planner joins their findings
into one answer.

The branches start from the planner's conversation, computed once and shared from the radix
cache; their tool calls run at once, each in its own branch, and their generations are batched
together by the engine.

    .venv/bin/python examples/multi_agent.py [--task TEXT] [--workers N] [--max-tokens N]
    radixlang run examples/multi_agent.py -- --workers 2
"""

from __future__ import annotations

import argparse
import time
from typing import Annotated

from agent_tools import TOOLS
from pydantic import BaseModel, Field

import radixlang as sgl

PLANNER = "You are a planner. You split a task into short, separate questions for your workers."
WORKER = "Answer the question with one tool call, then state the result in one sentence."


# A question in words (the schema's pattern holds a small model to one).
Question = Annotated[str, Field(pattern=r"^(How|What|Which) [A-Za-z0-9 ,']{4,70}[?]$")]


def plan_schema(workers: int) -> type[BaseModel]:
    class Plan(BaseModel):
        questions: list[Question] = Field(min_length=1, max_length=workers)

    return Plan


@sgl.function
def team(s, task: str, workers: int, max_tokens: int):
    s += sgl.system(PLANNER)
    s += sgl.user(f"Task: {task}\nWrite at most {workers} questions as JSON.")
    s += sgl.assistant(sgl.gen("plan", json_schema=plan_schema(workers), max_tokens=200,
                               temperature=0))  # fmt: skip
    questions = [q for q in s.parsed("plan").questions if q.strip()] or [task]
    branches = s.fork(len(questions))
    for question, branch in zip(questions, branches, strict=True):
        branch += sgl.user(f"{WORKER}\nQuestion: {question}")
        branch += sgl.assistant(sgl.gen("call", tools=TOOLS, tool_choice="required",
                                        max_tokens=max_tokens, temperature=0))  # fmt: skip
        branch += sgl.run_tools("call", timeout=10)
        branch += sgl.assistant(sgl.gen("finding", max_tokens=max_tokens, temperature=0,
                                        stop=["<tool_call>"]))  # fmt: skip
    branches.join()
    s["questions"] = questions
    findings = "\n".join(f"- {q} {f.strip()}" for q, f in zip(questions, s["finding"], strict=True))
    s += sgl.user(f"Your workers found:\n{findings}\nNow answer the task in two sentences.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="Compare the heights of Mount Everest and the "
                        "Eiffel Tower, in feet.")  # fmt: skip
    parser.add_argument("--workers", type=int, default=3, help="sub-questions (branches) at most")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        start = time.perf_counter()
        state = team.run(task=args.task, workers=args.workers, max_tokens=args.max_tokens)
        seconds = time.perf_counter() - start
        print(f"Task: {args.task}")
        for i, question in enumerate(state["questions"]):
            print(f"worker {i + 1}: {question}")
            calls, results = state.tool_calls("call")[i], state.tool_results("call")[i]
            for call, result in zip(calls, results, strict=True):
                print(f"  {call.name}({call.arguments}) -> {' '.join(result.content.split())[:90]}")
            print(f"  finding: {' '.join(state['finding'][i].split())}")
        print(f"answer: {' '.join(state['answer'].split())}")
        print(f"\n{len(state['questions'])} workers in parallel branches; done in {seconds:.1f} s")
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
