"""LLM programs on radixlang against the same programs on plain transformers and on llama.cpp.

One command:  .venv/bin/python benchmarks/bench_programs.py [--scale small|full]
Writes benchmarks/results/bench_programs.json and .png (speedup per workload).
The llama.cpp baseline needs a one-time build outside the repository (never part of CI):
``bash benchmarks/setup_llama_cpp.sh`` (about 17 minutes on 2 cores); without it the run skips
that baseline and says so (``--llama-cpp auto``, the default; ``on`` makes it an error).

Five workloads, each a program written with the SGLang frontend API (``import radixlang as
sgl``) and the same program written against plain transformers, making the same model calls
with the same prompts and the same maximum of new tokens:

- few_shot: a 20-example question-answering prefix and N questions through ``run_batch``;
  greedy, short answers that stop at a newline.
- self_consistency: one question with worked examples before it, ``fork(k)`` samples of a short
  chain of thought (temperature 0.7), then a majority vote in Python.
- tree_of_thought: branching b, depth d, every node a short sampled thought appended to its
  parent's text, all through ``fork``; the leaves vote.
- multi_turn: M conversations of T turns under one shared system prompt, ``user`` /
  ``assistant(gen(...))``; greedy.
- select: N questions, each choosing among 4 answers with ``select`` (mean log-probability of
  the choice's tokens, SGLang's default).

transformers runs each program twice: "sequential" (every model call is its own ``generate`` on
the full prompt; for select one forward per choice) and "batched" (the calls the program could
issue at the same time, i.e. the batch items, one fork level, one turn across conversations, go
together into one left-padded ``generate``, up to ``--max-batch`` rows). radixlang's time is
compared with the faster of the two. Where a workload samples or runs to its length limit, EOS
is ignored on both sides (``ignore_eos`` / ``min_new_tokens``) so both generate the same number
of tokens; the generated-token totals of every side are in the JSON. ``--dtype auto`` (the
default) is radixlang's own default dtype (``choose_dtype``): float32 on a CPU without native
bfloat16, bfloat16 on most GPUs; both sides run it and the JSON records it.

llama.cpp runs the same baseline programs (the same prompts, as token ids from the same
tokenizer, and the same generation parameters) on llama-server (``benchmarks/llama_cpp.py``),
once per GGUF file of ``--llama-gguf``: ``q4_1`` is the file the default model ships as, ``f32``
the same weights unquantized (what radixlang and transformers compute with on this CPU). The
server has 8 slots, continuous batching and its prompt cache on; the calls a program could issue
together go out concurrently; each workload gets a freshly started server (a cold cache). Its
responses count the prompt tokens it computed and the ones its prompt cache held. llama-server
scores no prompt tokens, so ``select`` forces each choice's tokens through generation with a
token grammar and reads their log-probabilities from the raw logits (one decode step a token).
The named GGUF files are of the default model only (another ``--model`` takes ``--llama-gguf
PATH.gguf``). ``speedup_vs_llama_cpp_<gguf>`` is llama.cpp's time over radixlang's.

Every radixlang workload starts on a flushed cache. Its engine statistics say how many prompt
tokens were computed and how many reused (radixlang's own counts include the requests that
cache a shared prefix before a fork or a batch). ``prompt_trie_tokens`` is the number of
distinct tokens in the trie of all prompts the program sends (counted over the prompts the
sequential baseline sent, the same set up to sampling); ``prompt_trie_tokens_not_generated``
leaves out those that an earlier call generated, whose KV a cache of whole sequences already
holds: the optimum that ``radixlang_computed_over_optimum`` compares against.

transformers runs first, each program on a short-lived thread, then llama.cpp (its server the
only busy process), then radixlang: never two at once, and only one thread owns an OpenMP team
at a time (see ``in_thread``). Ratios are what to read: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime.dtype_choice import choose_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp
from bench_engine import in_thread
from provenance import provenance

WORKLOADS = ("few_shot", "self_consistency", "tree_of_thought", "multi_turn", "select")
# Speedup over the faster baseline that the project reports against.
TARGETS = {"few_shot": 5.0, "tree_of_thought": 5.0, "multi_turn": 2.0}
# radixlang engine counters reported per workload (deltas over the workload's run).
ENGINE_COUNTERS = (
    "prompt_tokens",
    "prompt_tokens_computed",
    "prompt_tokens_reused",
    "recomputed_tokens",
    "generated_tokens",
    "finished_requests",
    "retractions",
)


# ---- sizes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    few_shot_examples: int
    few_shot_questions: int
    few_shot_max_tokens: int
    sc_samples: int
    sc_max_tokens: int
    tot_branching: int
    tot_depth: int
    tot_max_tokens: int
    chat_conversations: int
    chat_turns: int
    chat_max_tokens: int
    select_items: int


SCALES = {
    "full": Scale(
        few_shot_examples=20,
        few_shot_questions=32,
        few_shot_max_tokens=16,
        sc_samples=8,
        sc_max_tokens=48,
        tot_branching=3,
        tot_depth=3,
        tot_max_tokens=24,
        chat_conversations=8,
        chat_turns=4,
        chat_max_tokens=32,
        select_items=32,
    ),
    "small": Scale(
        few_shot_examples=20,
        few_shot_questions=4,
        few_shot_max_tokens=8,
        sc_samples=3,
        sc_max_tokens=12,
        tot_branching=2,
        tot_depth=2,
        tot_max_tokens=8,
        chat_conversations=2,
        chat_turns=2,
        chat_max_tokens=8,
        select_items=4,
    ),
}

SAMPLING_TEMPERATURE = 0.7

# ---- the programs' text, built in code -------------------------------------------------------
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Russia", "Moscow"),
    ("China", "Beijing"), ("India", "New Delhi"), ("Mexico", "Mexico City"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Poland", "Warsaw"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Cuba", "Havana"), ("Chile", "Santiago"),
    ("Colombia", "Bogota"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Syria", "Damascus"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
    ("Philippines", "Manila"), ("South Korea", "Seoul"), ("Australia", "Canberra"),
    ("New Zealand", "Wellington"), ("Brazil", "Brasilia"), ("Venezuela", "Caracas"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Czech Republic", "Prague"), ("Switzerland", "Bern"), ("Netherlands", "Amsterdam"),
    ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"), ("Pakistan", "Islamabad"), ("Nepal", "Kathmandu"),
]  # fmt: skip

SC_EXAMPLES = [
    (
        "Tom has 3 boxes with 4 apples in each box. He eats 2 apples. How many apples are left?",
        "3 boxes of 4 apples is 3 * 4 = 12 apples. After eating 2, 12 - 2 = 10 are left. "
        "The answer is 10.",
    ),
    (
        "A train travels 60 km in one hour. How far does it travel in 3 hours?",
        "Each hour it travels 60 km, so in 3 hours it travels 3 * 60 = 180 km. The answer is 180.",
    ),
    (
        "Sara had 25 stickers. She gave 7 to her brother and bought 5 more. How many does she "
        "have now?",
        "She starts with 25. Giving 7 away leaves 25 - 7 = 18. Buying 5 more gives 18 + 5 = 23. "
        "The answer is 23.",
    ),
    (
        "A pizza is cut into 8 slices. Four friends each eat 2 slices. How many slices are left?",
        "Four friends eat 4 * 2 = 8 slices. 8 - 8 = 0 slices are left. The answer is 0.",
    ),
]
SC_QUESTION = (
    "A baker makes 24 rolls in the morning and 17 rolls in the afternoon. He sells 29 rolls. "
    "How many rolls are left?"
)

TOT_PROMPT = (
    "You solve problems by thinking in small steps. Each step is one short thought that builds "
    "on the steps before it. When you know the result, say it as a number.\n\n"
    "Problem: A farmer has 12 cows and 9 sheep. He buys 3 times as many goats as cows and "
    "sells 5 sheep. How many animals does he have now?\n"
)

CHAT_SYSTEM = (
    "You are a friendly and knowledgeable science tutor for curious students. Explain ideas "
    "in plain language, use short sentences, and give concrete everyday examples. When a "
    "student asks a follow-up question, connect your answer to what you said before. Avoid "
    "jargon; when you must use a technical word, define it in a few words. Be accurate: if "
    "something is uncertain or debated among scientists, say so. Keep every answer brief, "
    "at most three sentences, and end with a question that invites the student to think "
    "further about the topic."
)
CHAT_TOPICS = [
    "the water cycle", "photosynthesis", "volcanoes", "the phases of the moon",
    "honey bees", "rainbows", "earthquakes", "how vaccines work",
    "black holes", "ocean tides", "the human heart", "static electricity",
]  # fmt: skip
CHAT_TURNS = [
    "Can you explain {topic} to me?",
    "Why does that matter in everyday life?",
    "Give me one surprising fact about it.",
    "What is a common misconception about it?",
    "How do scientists study it?",
    "Summarize our conversation in one sentence.",
]


def few_shot_prefix(examples: int) -> str:
    text = "Answer each question with the name of a city.\n\n"
    for country, capital in CAPITALS[:examples]:
        text += f"Q: What is the capital of {country}?\nA: {capital}\n\n"
    return text


def few_shot_items(scale: Scale) -> list[tuple[str, str]]:
    """(question, answer) pairs not among the prefix's examples."""
    pool = CAPITALS[scale.few_shot_examples :]
    items = [pool[i % len(pool)] for i in range(scale.few_shot_questions)]
    return [(f"What is the capital of {country}?", capital) for country, capital in items]


def select_items(scale: Scale) -> list[tuple[str, list[str], str]]:
    """(question, four choices with a leading space, the right choice)."""
    pool = CAPITALS[scale.few_shot_examples :]
    items = []
    for i in range(scale.select_items):
        country, capital = pool[i % len(pool)]
        rng = random.Random(i)
        wrong = rng.sample([c for _, c in CAPITALS if c != capital], 3)
        choices = [f" {c}" for c in [capital, *wrong]]
        rng.shuffle(choices)
        items.append((f"What is the capital of {country}?", choices, f" {capital}"))
    return items


def self_consistency_prompt() -> str:
    text = "Solve each problem. Think step by step, then give the answer as a number.\n\n"
    for question, solution in SC_EXAMPLES:
        text += f"Q: {question}\nA: {solution}\n\n"
    return text + f"Q: {SC_QUESTION}\nA:"


def chat_conversations(scale: Scale) -> list[list[str]]:
    turns = CHAT_TURNS[: scale.chat_turns]
    topics = [CHAT_TOPICS[c % len(CHAT_TOPICS)] for c in range(scale.chat_conversations)]
    return [[turn.format(topic=topic) for turn in turns] for topic in topics]


_ANSWER = re.compile(r"answer is\s*\$?(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


def extract_number(text: str) -> str | None:
    """The stated answer ("The answer is N"), else the last number in the text."""
    m = _ANSWER.search(text)
    if m:
        return m.group(1)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def majority(values: Sequence[str | None]) -> str | None:
    counts = collections.Counter(v for v in values if v is not None)
    return counts.most_common(1)[0][0] if counts else None


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_trie_tokens(
    prompts: Sequence[Sequence[int]],
    generated: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
) -> int:
    """Distinct tokens in the trie of ``prompts``: what a perfect cache of prompts computes.

    With ``generated`` (each call's prompt and output ids), only the distinct prompt tokens
    that no call generated: the optimum for a cache that also keeps generated tokens (as
    radixlang's does; their KV was computed while decoding). A call's last output token never
    went through the model, so it does not count as generated.
    """
    children: list[dict[int, int]] = [{}]
    decoded = [False]

    def walk(seq: Sequence[int], first_decoded: int) -> list[int]:
        node, path = 0, []
        for i, token in enumerate(seq):
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = len(children)
                children.append({})
                decoded.append(False)
            decoded[child] = decoded[child] or i >= first_decoded
            path.append(child)
            node = child
        return path

    for prompt, output in generated:
        walk([*prompt, *output[:-1]], len(prompt))
    nodes = {n for p in prompts for n in walk(p, len(p))}
    return sum(not decoded[n] for n in nodes)


# ---- the plain transformers side -------------------------------------------------------------
@dataclass(frozen=True)
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    stop: str | None = None
    # Generate exactly max_tokens: ignore_eos on radixlang, min_new_tokens on transformers.
    force_length: bool = False


class Transformers:
    """A plain-transformers "backend" for the baseline programs.

    ``generate(prompts)`` takes the calls a program could issue together: sequential mode runs
    one ``model.generate`` per prompt, batched mode one left-padded ``generate`` per group of up
    to ``max_batch`` prompts. Counts the model invocations, the prompt and generated tokens, and
    keeps every prompt's token ids (for the trie optimum).
    """

    def __init__(
        self, model: Any, tokenizer: Any, device: str, batched: bool, max_batch: int
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.batch = max_batch if batched else 1
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        )
        self.model_calls = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prompts: list[list[int]] = []
        self.generated: list[tuple[list[int], list[int]]] = []  # (prompt ids, output ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _left_pad(self, group: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, group))
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate(self, prompts: list[str], params: GenParams) -> list[str]:
        ids = [self.encode(p) for p in prompts]
        self.prompts += ids
        self.requests += len(ids)
        self.prompt_tokens += sum(map(len, ids))
        texts: list[str] = []
        for i in range(0, len(ids), self.batch):
            texts += self._generate(ids[i : i + self.batch], params)
        return texts

    def _generate(self, group: list[list[int]], params: GenParams) -> list[str]:
        ids, mask = self._left_pad(group)
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self.pad_id,
            "do_sample": params.temperature > 0,
        }
        if params.temperature > 0:
            kwargs.update(temperature=params.temperature, top_k=0, top_p=1.0)
        if params.force_length:
            kwargs["min_new_tokens"] = params.max_tokens
        if params.stop:
            kwargs.update(stop_strings=[params.stop], tokenizer=self.tokenizer)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, **kwargs)
        self.model_calls += 1
        texts = []
        for prompt, row in zip(group, out[:, ids.shape[1] :].tolist(), strict=True):
            text, output = self._finish(row, params)
            self.generated.append((prompt, output))
            texts.append(text)
        return texts

    def _finish(self, row: list[int], params: GenParams) -> tuple[str, list[int]]:
        """The text and the ids of one generated row, up to where it stopped (EOS, a stop
        string): a finished row of a batch goes on with padding."""
        n = len(row)
        if not params.force_length:
            n = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), n)
        decode = self.tokenizer.decode
        if params.stop:
            n = next((i for i in range(1, n + 1) if params.stop in decode(row[:i])), n)
        self.generated_tokens += n
        text = decode(row[:n], skip_special_tokens=True)
        return (text.split(params.stop)[0] if params.stop else text), row[:n]

    def select(self, prompts: list[str], choices: list[list[str]]) -> list[int]:
        """For each prompt, the index of the choice with the highest mean log-probability of its
        tokens after the prompt; one forward per choice, or batched over all choices."""
        seqs: list[tuple[list[int], int]] = []  # (prompt + choice ids, where scoring starts)
        for prompt, options in zip(prompts, choices, strict=True):
            head = self.encode(prompt)
            fulls = [self.encode(prompt + option) for option in options]
            # All of a prompt's choices are scored from the first position where any of them
            # departs from the prompt's own tokens (as radixlang's select does).
            start = min(common_prefix_len(head, full) for full in fulls)
            start = max(1, min(start, *(len(full) - 1 for full in fulls)))
            seqs += [(full, start) for full in fulls]
        self.prompts += [full for full, _ in seqs]
        self.requests += len(seqs)
        self.prompt_tokens += sum(len(full) for full, _ in seqs)
        scores: list[float] = []
        for i in range(0, len(seqs), self.batch):
            scores += self._score(seqs[i : i + self.batch])
        picks, k = [], 0
        for options in choices:
            row = scores[k : k + len(options)]
            picks.append(max(range(len(options)), key=row.__getitem__))
            k += len(options)
        return picks

    def _score(self, group: list[tuple[list[int], int]]) -> list[float]:
        ids, mask = self._left_pad([full for full, _ in group])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(full) - start for full, start in group) + 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep
            ).logits.float()
        self.model_calls += 1
        logprobs = torch.log_softmax(logits, dim=-1).cpu()
        scores = []
        for row, (full, start) in enumerate(group):
            m = len(full) - start  # the choice's tokens are the row's last m
            targets = torch.tensor(full[-m:])
            lp = logprobs[row, keep - 1 - m : keep - 1].gather(-1, targets[:, None])
            scores.append(lp.mean().item())
        return scores

    def counts(self) -> dict[str, int]:
        return {
            "model_calls": self.model_calls,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
        }


def load_transformers(path: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()


# ---- the workloads ---------------------------------------------------------------------------
class Workload:
    """One program, written for transformers (``baseline``) and for radixlang (``program``)."""

    name = ""
    description = ""

    def __init__(self, scale: Scale) -> None:
        self.scale = scale

    def params(self) -> dict[str, Any]:
        return {}

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        raise NotImplementedError

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        """Defines the radixlang program and returns a call that runs it (the timed part)."""
        raise NotImplementedError


class FewShot(Workload):
    name = "few_shot"
    description = "few-shot QA prefix + N questions via run_batch, greedy, stop at newline"

    def __init__(self, scale: Scale) -> None:
        super().__init__(scale)
        self.prefix = few_shot_prefix(scale.few_shot_examples)
        self.items = few_shot_items(scale)
        self.gen = GenParams(scale.few_shot_max_tokens, stop="\n")

    def params(self) -> dict[str, Any]:
        return {
            "examples": self.scale.few_shot_examples,
            "questions": len(self.items),
            "max_tokens": self.gen.max_tokens,
            "stop": self.gen.stop,
            "temperature": 0.0,
        }

    def score(self, answers: list[str]) -> dict[str, Any]:
        right = sum(a.strip() == truth for a, (_, truth) in zip(answers, self.items, strict=True))
        return {"accuracy": right / len(self.items), "answers": answers[:8]}

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        prompts = [f"{self.prefix}Q: {q}\nA:" for q, _ in self.items]
        return self.score([a.strip() for a in lm.generate(prompts, self.gen)])

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        prefix, max_tokens = self.prefix, self.gen.max_tokens

        @sgl.function
        def few_shot_qa(s: Any, question: str) -> None:
            s += prefix + "Q: " + question + "\nA:"
            s += sgl.gen("answer", max_tokens=max_tokens, stop="\n")

        def run() -> dict[str, Any]:
            states = few_shot_qa.run_batch(
                [{"question": q} for q, _ in self.items], temperature=0, num_threads="auto"
            )
            return self.score([st["answer"].strip() for st in states])

        return run


class SelfConsistency(Workload):
    name = "self_consistency"
    description = "one question, fork(k) sampled chains of thought, majority vote"

    def __init__(self, scale: Scale) -> None:
        super().__init__(scale)
        self.prompt = self_consistency_prompt()
        self.k = scale.sc_samples
        self.gen = GenParams(scale.sc_max_tokens, SAMPLING_TEMPERATURE, force_length=True)

    def params(self) -> dict[str, Any]:
        return {"samples": self.k, **asdict(self.gen)}

    def vote(self, chains: list[str]) -> dict[str, Any]:
        answers = [extract_number(c) for c in chains]
        return {"answers": answers, "vote": majority(answers), "truth": "12"}

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        return self.vote(lm.generate([self.prompt] * self.k, self.gen))

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        prompt, k, gen = self.prompt, self.k, self.gen

        @sgl.function
        def self_consistency(s: Any, sink: list[str]) -> None:
            s += prompt
            forks = s.fork(k)
            for f in forks:
                f += sgl.gen(
                    "chain",
                    max_tokens=gen.max_tokens,
                    temperature=gen.temperature,
                    ignore_eos=gen.force_length,
                )
            sink.extend(f["chain"] for f in forks)
            forks.join()

        def run() -> dict[str, Any]:
            chains: list[str] = []
            self_consistency.run(sink=chains)
            return self.vote(chains)

        return run


class TreeOfThought(Workload):
    name = "tree_of_thought"
    description = "branching b, depth d; each node a sampled thought after its parent's text"

    def __init__(self, scale: Scale) -> None:
        super().__init__(scale)
        self.branching = scale.tot_branching
        self.depth = scale.tot_depth
        self.gen = GenParams(scale.tot_max_tokens, SAMPLING_TEMPERATURE, force_length=True)

    def params(self) -> dict[str, Any]:
        nodes = sum(self.branching**level for level in range(1, self.depth + 1))
        return {
            "branching": self.branching,
            "depth": self.depth,
            "leaves": self.branching**self.depth,
            "gen_calls": nodes,
            **asdict(self.gen),
        }

    def vote(self, leaves: list[str]) -> dict[str, Any]:
        answers = [extract_number(leaf[len(TOT_PROMPT) :]) for leaf in leaves]
        return {"leaves": len(leaves), "vote": majority(answers), "truth": "52"}

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        frontier = [TOT_PROMPT]
        for level in range(self.depth):
            prompts = [t + f"Step {level + 1}:" for t in frontier for _ in range(self.branching)]
            thoughts = lm.generate(prompts, self.gen)  # one fork level issued together
            frontier = [p + t + "\n" for p, t in zip(prompts, thoughts, strict=True)]
        return self.vote(frontier)

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        branching, depth, gen = self.branching, self.depth, self.gen

        @sgl.function
        def tree_of_thought(s: Any, sink: list[str]) -> None:
            s += TOT_PROMPT
            frontier = [s]
            for level in range(depth):
                children = []
                for node in frontier:
                    forks = node.fork(branching)
                    for f in forks:
                        f += f"Step {level + 1}:"
                        f += sgl.gen(
                            "thought",
                            max_tokens=gen.max_tokens,
                            temperature=gen.temperature,
                            ignore_eos=gen.force_length,
                        )
                        f += "\n"
                    children.extend(forks)
                frontier = children
            sink.extend(leaf.text() for leaf in frontier)

        def run() -> dict[str, Any]:
            leaves: list[str] = []
            tree_of_thought.run(sink=leaves)
            return self.vote(leaves)

        return run


class MultiTurn(Workload):
    name = "multi_turn"
    description = "M conversations x T turns under a shared system prompt, greedy"

    def __init__(self, scale: Scale) -> None:
        super().__init__(scale)
        self.conversations = chat_conversations(scale)
        self.gen = GenParams(scale.chat_max_tokens, force_length=True)

    def params(self) -> dict[str, Any]:
        return {
            "conversations": len(self.conversations),
            "turns": self.scale.chat_turns,
            **asdict(self.gen),
        }

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        chats = [[{"role": "system", "content": CHAT_SYSTEM}] for _ in self.conversations]
        for turn in range(self.scale.chat_turns):  # one turn across conversations together
            for chat, questions in zip(chats, self.conversations, strict=True):
                chat.append({"role": "user", "content": questions[turn]})
            prompts = [
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                for chat in chats
            ]
            for chat, reply in zip(chats, lm.generate(prompts, self.gen), strict=True):
                chat.append({"role": "assistant", "content": reply})
        return {"first_reply": chats[0][2]["content"]}

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        gen = self.gen

        @sgl.function
        def chat(s: Any, questions: list[str]) -> None:
            s += sgl.system(CHAT_SYSTEM)
            for turn, question in enumerate(questions):
                s += sgl.user(question)
                s += sgl.assistant(
                    sgl.gen(f"reply{turn}", max_tokens=gen.max_tokens, ignore_eos=gen.force_length)
                )

        def run() -> dict[str, Any]:
            states = chat.run_batch(
                [{"questions": q} for q in self.conversations], temperature=0, num_threads="auto"
            )
            return {"first_reply": states[0]["reply0"]}

        return run


class Select(Workload):
    name = "select"
    description = "N questions (few-shot prefix), each a select among 4 choices"

    def __init__(self, scale: Scale) -> None:
        super().__init__(scale)
        self.prefix = few_shot_prefix(scale.few_shot_examples)
        self.items = select_items(scale)

    def params(self) -> dict[str, Any]:
        return {"items": len(self.items), "choices": 4, "method": "token_length_normalized"}

    def score(self, picks: list[str]) -> dict[str, Any]:
        right = sum(p == truth for p, (_, _, truth) in zip(picks, self.items, strict=True))
        return {"accuracy": right / len(self.items), "picks": [p.strip() for p in picks[:8]]}

    def baseline(self, lm: Transformers, tokenizer: Any) -> dict[str, Any]:
        prompts = [f"{self.prefix}Q: {q}\nA:" for q, _, _ in self.items]
        picks = lm.select(prompts, [choices for _, choices, _ in self.items])
        return self.score([c[i] for (_, c, _), i in zip(self.items, picks, strict=True)])

    def program(self, sgl: Any) -> Callable[[], dict[str, Any]]:
        prefix = self.prefix

        @sgl.function
        def pick(s: Any, question: str, choices: list[str]) -> None:
            s += prefix + "Q: " + question + "\nA:"
            s += sgl.select("answer", choices=choices)

        def run() -> dict[str, Any]:
            states = pick.run_batch(
                [{"question": q, "choices": c} for q, c, _ in self.items], num_threads="auto"
            )
            return self.score([st["answer"] for st in states])

        return run


WORKLOAD_CLASSES: dict[str, type[Workload]] = {
    cls.name: cls for cls in (FewShot, SelfConsistency, TreeOfThought, MultiTurn, Select)
}


# ---- running both sides ----------------------------------------------------------------------
def progress(workloads: list[Workload], desc: str) -> tqdm:
    """The workloads with a progress bar on stderr (on a terminal only; gone when done)."""
    return tqdm(workloads, desc=desc, unit="workload", file=sys.stderr, leave=False, disable=None)


def log(line: str) -> None:
    """A line above the progress bar, flushed: a long run's log is read while it runs."""
    tqdm.write(line)
    sys.stdout.flush()


def run_baselines(
    workloads: list[Workload], files: Any, tokenizer: Any, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Every workload on transformers, sequential then batched, each on a short-lived thread."""
    model = in_thread(load_transformers, files.path, getattr(torch, args.dtype), args.device)
    warm = Transformers(model, tokenizer, args.device, batched=True, max_batch=args.max_batch)
    in_thread(warm.generate, ["Hello", "Hi there"], GenParams(2, stop="\n"))  # warm up
    results: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    for w in progress(workloads, "transformers"):
        for mode in ("sequential", "batched"):
            lm = Transformers(
                model, tokenizer, args.device, batched=mode == "batched", max_batch=args.max_batch
            )

            def timed(w: Workload = w, lm: Transformers = lm) -> tuple[float, dict[str, Any]]:
                start = time.perf_counter()
                out = w.baseline(lm, tokenizer)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                return time.perf_counter() - start, out

            seconds, out = in_thread(timed)
            entry = {"seconds": seconds, **lm.counts(), "loadavg_1min": os.getloadavg()[0]}
            entry["result"] = out
            if mode == "sequential":
                entry["prompt_trie_tokens"] = prompt_trie_tokens(lm.prompts)
                entry["prompt_trie_tokens_not_generated"] = prompt_trie_tokens(
                    lm.prompts, lm.generated
                )
            results[w.name][mode] = entry
            log(
                f"  {w.name:17s} transformers {mode:10s} {seconds:7.2f} s  "
                f"{lm.model_calls:4d} calls  {lm.generated_tokens:5d} generated",
            )
    del model
    return results


@dataclass
class LlamaCppPlan:
    """What the llama.cpp baseline runs (the server, the GGUF files by label), or why not."""

    server: Path | None = None
    ggufs: dict[str, Path] | None = None
    skipped: str | None = None


def plan_llama_cpp(args: argparse.Namespace) -> LlamaCppPlan:
    """Finds llama-server and the GGUF files for ``--llama-cpp auto|on|off``: ``auto`` skips the
    baseline with a message when something is missing, ``on`` stops the run (SystemExit)."""
    if args.llama_cpp == "off":
        return LlamaCppPlan(skipped="--llama-cpp off")
    named = [g for g in args.llama_gguf if g in llama_cpp.GGUF_FILES]
    try:
        if named and args.model != DEFAULT_MODEL:
            raise llama_cpp.LlamaCppMissing(
                f"the GGUF files {', '.join(named)} are of the default model {DEFAULT_MODEL}, "
                f"not {args.model}: give --llama-gguf PATH.gguf of that model"
            )
        server = llama_cpp.find_server(args.llama_server)
        ggufs = {llama_cpp.gguf_label(g): llama_cpp.find_gguf(g) for g in args.llama_gguf}
    except llama_cpp.LlamaCppMissing as e:
        if args.llama_cpp == "on":
            raise SystemExit(f"--llama-cpp on: {e}") from e
        log(f"llama.cpp baseline skipped: {e}")
        return LlamaCppPlan(skipped=str(e))
    return LlamaCppPlan(server=server, ggufs=ggufs)


def run_llama_cpp(
    workloads: list[Workload], tokenizer: Any, plan: LlamaCppPlan
) -> dict[str, dict[str, Any]]:
    """Every workload's baseline program on llama-server, once per GGUF file; a fresh server
    (cold prompt cache, warmed up by a 2-token call) per workload and file."""
    assert plan.server is not None and plan.ggufs is not None
    results: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    for label, gguf in plan.ggufs.items():
        for w in progress(workloads, f"llama.cpp {label}"):
            with llama_cpp.LlamaServer(plan.server, gguf) as server:
                with llama_cpp.LlamaCpp(server.url, tokenizer) as warm:
                    warm.generate(["Hello", "Hi there"], GenParams(2, stop="\n"))
                with llama_cpp.LlamaCpp(server.url, tokenizer) as lm:
                    start = time.perf_counter()
                    out = w.baseline(lm, tokenizer)
                    seconds = time.perf_counter() - start
            counts = lm.counts()
            held = counts["prompt_tokens_cached"]
            total = held + counts["prompt_tokens_computed"]
            entry = {
                "seconds": seconds,
                **counts,
                "prompt_cache_hit_rate": held / total if total else 0.0,
                "loadavg_1min": os.getloadavg()[0],
                "gguf": str(gguf),
                "result": out,
            }
            if w.name == "select":
                entry["method"] = (
                    "each choice's tokens forced through generation by a token-id grammar, "
                    "log-probabilities from the raw logits (n_probs, post_sampling_probs off); "
                    "generated_tokens are those forced choice tokens"
                )
            results[w.name][label] = entry
            log(
                f"  {w.name:17s} llama.cpp {label:14s} {seconds:7.2f} s  "
                f"{counts['prompt_tokens_computed']} prompt tokens computed, {held} cached, "
                f"{counts['generated_tokens']} generated",
            )
    return results


def run_radixlang(workloads: list[Workload], args: argparse.Namespace) -> dict[str, Any]:
    import radixlang as sgl

    results: dict[str, Any] = {}
    rt = sgl.Runtime(
        model_path=args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory
    )
    try:
        sgl.set_default_backend(rt)

        @sgl.function
        def warm_up(s: Any) -> None:
            s += "Hello" + sgl.gen("x", max_tokens=2)

        warm_up.run()
        for w in progress(workloads, "radixlang"):
            run = w.program(sgl)
            rt.flush_cache()
            before = rt.stats()
            start = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - start
            # A call through the engine thread waits for its current step to end: a request's
            # result is handed out within the step, its tokens are counted after it.
            rt.engine.check_integrity()
            after = rt.stats()
            counters = {k: after[k] - before[k] for k in ENGINE_COUNTERS if k in after}
            reused, total = counters.get("prompt_tokens_reused", 0), counters.get("prompt_tokens")
            results[w.name] = {
                "seconds": seconds,
                **counters,
                "cache_hit_rate": reused / total if total else 0.0,
                "loadavg_1min": os.getloadavg()[0],
                "result": out,
            }
            log(
                f"  {w.name:17s} radixlang                {seconds:7.2f} s  "
                f"{counters.get('prompt_tokens_computed')} prompt tokens computed, "
                f"{reused} reused, {counters.get('generated_tokens')} generated",
            )
        rt.flush_cache()
        results["_final_stats"] = rt.stats()
    finally:
        rt.shutdown()
    return results


def summarize(
    name: str,
    base: dict[str, Any],
    ours: dict[str, Any],
    llama: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ratios of one workload; ``llama`` maps a GGUF label to llama.cpp's entry."""
    seq, bat = base["sequential"], base["batched"]
    best = "batched" if bat["seconds"] <= seq["seconds"] else "sequential"
    summary: dict[str, Any] = {
        "speedup_vs_sequential": seq["seconds"] / ours["seconds"],
        "speedup_vs_batched": bat["seconds"] / ours["seconds"],
        "best_baseline": best,
        "speedup_vs_best": base[best]["seconds"] / ours["seconds"],
        "generated_tokens": {
            "radixlang": ours.get("generated_tokens"),
            "sequential": seq["generated_tokens"],
            "batched": bat["generated_tokens"],
        },
        "prompt_tokens": {
            "radixlang": ours.get("prompt_tokens"),
            "sequential": seq["prompt_tokens"],
            "batched": bat["prompt_tokens"],
        },
        "prompt_trie_tokens": seq["prompt_trie_tokens"],
        "prompt_trie_tokens_not_generated": seq["prompt_trie_tokens_not_generated"],
        "radixlang_prompt_tokens_computed": ours.get("prompt_tokens_computed"),
    }
    for label, entry in (llama or {}).items():
        summary[f"speedup_vs_llama_cpp_{label}"] = entry["seconds"] / ours["seconds"]
        summary["generated_tokens"][f"llama_cpp_{label}"] = entry["generated_tokens"]
        summary["prompt_tokens"][f"llama_cpp_{label}"] = entry["prompt_tokens"]
        summary[f"llama_cpp_{label}_prompt_tokens_computed"] = entry["prompt_tokens_computed"]
        summary[f"llama_cpp_{label}_prompt_tokens_cached"] = entry["prompt_tokens_cached"]
    computed = ours.get("prompt_tokens_computed")
    if computed is not None:
        optimum = seq["prompt_trie_tokens_not_generated"]
        summary["radixlang_computed_over_optimum"] = computed / optimum
    if name in TARGETS:
        summary["target_speedup_vs_best"] = TARGETS[name]
        summary["target_met"] = summary["speedup_vs_best"] >= TARGETS[name]
    return summary


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    summaries = [result["workloads"][n]["summary"] for n in names]
    series = [
        ("speedup_vs_sequential", "vs sequential generate"),
        ("speedup_vs_batched", "vs batched"),
    ]
    for label in result.get("llama_cpp", {}).get("ggufs", {}):
        series.append((f"speedup_vs_llama_cpp_{label}", f"vs llama.cpp {label}"))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(series) * len(names) + 2), 4.5))
    width = 0.8 / len(series)
    for j, (key, label) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        values = [s.get(key, float("nan")) for s in summaries]
        bars = ax.bar(xs, values, width, label=f"radixlang {label}")
        ax.bar_label(bars, fmt="%.1fx", fontsize=7 if len(series) > 2 else 8)
    for i, s in enumerate(summaries):
        if "target_speedup_vs_best" in s:
            ax.hlines(s["target_speedup_vs_best"], i - 0.45, i + 0.45, colors="k", linestyles="--")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("baseline time / radixlang time")
    ax.set_title(
        f"LLM programs, {result['model']} {result['dtype']} on {result['machine']['device']}, "
        f"scale {result['scale']} (dashed: target vs the faster baseline)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def llama_cpp_info(plan: LlamaCppPlan) -> dict[str, Any]:
    """The JSON's account of the llama.cpp baseline: the server, its version, the files."""
    if plan.skipped is not None:
        return {"skipped": plan.skipped}
    assert plan.server is not None and plan.ggufs is not None
    return {
        "server": str(plan.server),
        "server_version": llama_cpp.server_version(plan.server),
        "llama_cpp_python_sdist": llama_cpp.pinned_version(),
        "ggufs": {label: str(path) for label, path in plan.ggufs.items()},
        "server_command": llama_cpp.server_command(plan.server, Path("GGUF"), "PORT")[1:],
        "note": "a fresh server per workload and GGUF file (cold prompt cache); prompts sent "
        "as the tokenizer's token ids; up to 8 concurrent /completion requests",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: radixlang's default for the device (float32 on a CPU without native bf16)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--scale", default="full", choices=sorted(SCALES))
    parser.add_argument(
        "--max-batch", type=int, default=64, help="most rows in one transformers call"
    )
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_programs.json"
    )
    parser.add_argument(
        "--llama-cpp",
        default="auto",
        choices=["auto", "on", "off"],
        help="the llama.cpp baseline: auto runs it when llama-server and the GGUF files exist "
        f"(else says how to build them: {llama_cpp.SETUP_COMMAND}), on requires it",
    )
    parser.add_argument(
        "--llama-gguf",
        nargs="+",
        default=list(llama_cpp.GGUF_FILES),
        metavar="GGUF",
        help=f"GGUF files to run llama.cpp on: {' / '.join(llama_cpp.GGUF_FILES)} (the default "
        "model's, built by the setup script) or paths to .gguf files",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"the llama-server binary (default: ${llama_cpp.SERVER_ENV}, else the setup "
        "script's build)",
    )
    args = parser.parse_args(argv)
    dtype_requested = args.dtype
    dtype = choose_dtype(args.dtype, args.device)
    args.dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")

    load_before = os.getloadavg()
    plan = plan_llama_cpp(args)
    files = load_model_files(args.model)
    tokenizer = files.load_tokenizer()
    scale = SCALES[args.scale]
    workloads = [WORKLOAD_CLASSES[name](scale) for name in args.workloads]
    print(f"transformers ({args.dtype}, {args.device}):", flush=True)
    baselines = run_baselines(workloads, files, tokenizer, args)
    llama: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    if plan.skipped is None:
        print(f"llama.cpp ({', '.join(plan.ggufs or {})}, {plan.server}):", flush=True)
        llama = run_llama_cpp(workloads, tokenizer, plan)
    print(f"radixlang ({args.dtype}, {args.device}):", flush=True)
    ours = run_radixlang(workloads, args)

    result: dict[str, Any] = {
        "benchmark": "bench_programs",
        "provenance": provenance(argv),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
            # 1/5/15-minute load averages: other jobs on a shared machine skew the timings.
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "model": files.name,
        "dtype": args.dtype,
        "scale": args.scale,
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "dtype_requested": dtype_requested,
            "scale_params": asdict(scale),
        },
        "llama_cpp": llama_cpp_info(plan),
        "workloads": {},
    }
    for w in workloads:
        summary = summarize(w.name, baselines[w.name], ours[w.name], llama[w.name])
        result["workloads"][w.name] = {
            "description": w.description,
            "params": w.params(),
            "radixlang": ours[w.name],
            **baselines[w.name],
            "llama_cpp": llama[w.name] if plan.skipped is None else {"skipped": plan.skipped},
            "summary": summary,
        }
        target = ""
        if "target_met" in summary:
            met = "met" if summary["target_met"] else "NOT met"
            target = f"  (target {summary['target_speedup_vs_best']:.0f}x: {met})"
        vs_llama = "".join(
            f", {summary[f'speedup_vs_llama_cpp_{label}']:6.2f}x vs llama.cpp {label}"
            for label in llama[w.name]
        )
        print(
            f"{w.name:17s} {summary['speedup_vs_sequential']:6.2f}x vs sequential, "
            f"{summary['speedup_vs_batched']:6.2f}x vs batched{vs_llama}{target}"
        )
    result["engine_stats_after"] = ours["_final_stats"]
    result["summary"] = {
        name: entry["summary"]["speedup_vs_best"] for name, entry in result["workloads"].items()
    }
    result["summary_vs_llama_cpp"] = {
        label: {
            name: entry["summary"][f"speedup_vs_llama_cpp_{label}"]
            for name, entry in result["workloads"].items()
        }
        for label in (plan.ggufs or {})
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
