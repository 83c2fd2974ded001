"""Agents that pause at tool calls: plain LRU against retention, the host tier (and a disk tier
under it) and program-aware scheduling, and llama-server with its caches, on the same seeded
traces.

One command:  .venv/bin/python benchmarks/bench_agents.py [--traffic chat | --traces coding]
              [--disk-probe] [--agents N] [--repeats N]
Writes benchmarks/results/bench_agents.json and .png (job completion time per configuration
and pool size); ``--traffic chat`` writes bench_agents_chat.*, ``--traces coding``
bench_agents_coding.*, ``--disk-probe`` alone bench_agents_disk_probe.* (``--out`` names
another file).

The default traces (seeded): ``--agents`` concurrent ReAct-style agents share one team system
prompt; each has its own task and ``--min-steps`` to ``--max-steps`` steps. A step is one model
call (``--step-tokens`` generated, EOS ignored) on the agent's whole history; then its tool runs
for a log-normal time (median ``--tool-median-s``, clipped to 50 ms .. ``--tool-max-s``) and
returns 50..``--tool-max-tokens`` tokens, appended with the call's output; the next step sends
the longer prompt. Agents start ``--stagger-s`` apart. Prompts are token ids (random, from the
model's vocabulary): the cache's work does not depend on what they say.

``--traffic chat``: the same kind of agents (16 x 6 steps by default) as text over the
OpenAI-compatible server, started in this process on each configuration's engine: every agent
is a thread posting its whole conversation to ``/v1/chat/completions`` (a ~350-token shared
system prompt, its task, then per step the assistant's reply and an ``Observation:`` of
100-300 words as the next user message), with its routing key and ``retain_s``; it releases
its retention (``/release_program``) when it ends. The text is English words drawn from a
fixed list by the seeded generator. Engine counters are read from the server's
``/get_server_info``.

``--traces coding``: long-context coding agents (4 by default): each agent's context grows to
``--ctx-min``..``--ctx-max`` tokens (16k-32k) over ``--min-steps``..``--max-steps`` turns,
tool outputs (file reads, test logs) of ``--tool-min-tokens``..``--tool-max-tokens``
(200-4,000). The default model's context is 8,192 tokens, so these run on a random-weight
model of its exact shape with a 32,768-token context (written once under
``~/.cache/radixlang-bench/models/``; speed does not depend on the weights' values).
llama-server (when built) serves an F32 GGUF of the same model, with 32,768 tokens a slot and
its host-memory prompt cache (``--cache-ram``). ``--disk-probe``: time to first token of a
16k-token prefix loaded from the disk tier against computing it fresh. What they cost: on a
2-core AVX2 CPU in float32 the engine prefilled ~170 tokens/s at 4k tokens of context and ~80
at 16k, so computing 4 agents' paths once (~87k tokens) takes about half an hour, and plain LRU
at a small pool computes several times that; scale ``--ctx-min``/``--ctx-max`` down there.

The KV pool holds a share (``--pools``) of the working set (every agent's final path, the
system prompt once), never less than ``--pool-floor`` times the longest agent's path (a
request's whole path must fit). Configurations, each on a fresh engine:

- ``plain``: LRU eviction and the default schedule policy (lpm); calls ask for no retention.
- ``retain``: each call asks the engine to retain its path for the agent's next call
  (``retain_s``, keyed by the agent's routing key), released when the agent ends.
- ``retain+tier``: the same, with a host tier (``--tier-factor`` times the working set) that
  evicted paths go to.
- ``retain+tier+program``: the same, with the "program" schedule policy (least attained
  service first, as Autellix); ``retain+tier+fcfs``: with first-come-first-served admission.
- ``retain+tier+disk``: a host tier of ``--disk-host-share`` of the working set and a disk tier
  under it (``disk_tier_size``, files under ``cache_dir``); skipped with a note on an engine
  without the setting.
- ``llama-server`` (when built: ``bash benchmarks/setup_llama_cpp.sh``): the same traces as
  concurrent ``/completion`` calls with the prompt cache on; 8 slots each as long as the longest
  agent's path (at least 2048 tokens) at the 100% pool of the default traces; for the coding
  traces, slots of 32,768 tokens, as many as the pool holds (at least one), and the host prompt
  cache as large as the host tier.

Reported per run: job completion time (an agent's first call to its last answer: mean, p50,
p99), and its ratio to the 100% pool's run of the same configuration; prompt tokens computed
(and recomputed after retractions) against the optimum (the distinct tokens of all prompts'
trie, less those a call generated, whose KV its decode already computed; for chat, the trie of
the prompts as the chat template renders them, nothing subtracted); generated tokens per second
over the run; the engine's counters over the run (tier traffic included). Each configuration
runs ``--repeats`` times, alternating; the JSON keeps every run and the spread. Nothing else
may run beside it: the machines are shared and noisy, ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp
from provenance import provenance

from radixlang.runtime.engine import Engine
from radixlang.runtime.request import GenerateRequest

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = (
    "plain",
    "retain",
    "retain+tier",
    "retain+tier+program",
    "retain+tier+fcfs",
    "retain+tier+disk",
)
LONG_CONTEXT = 32768  # the coding traces' model context (and llama-server's per slot)
ACCEPTANCE = {"config": "retain+tier", "pool": "25%", "p99": 1.10, "mean": 1.03}

# Per workload: the defaults of the flags left unset (None).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "react": dict(agents=32, min_steps=4, max_steps=12, system_tokens=300, task_tokens=40,
                  tool_min_tokens=50, tool_max_tokens=400, pools="1.0,0.25",
                  configs="plain,retain,retain+tier,retain+tier+program", repeats=2,
                  pool_floor=1.5, tier_factor=2.0, llama_pools="1.0"),
    "chat": dict(agents=16, min_steps=6, max_steps=6, pools="1.0,0.25",
                 configs="plain,retain+tier", repeats=2, pool_floor=1.5, tier_factor=2.0,
                 llama_pools=""),
    "coding": dict(agents=4, min_steps=8, max_steps=12, system_tokens=2000, task_tokens=200,
                   tool_min_tokens=200, tool_max_tokens=4000, pools="1.0,0.5,0.25",
                   configs="plain,retain+tier,retain+tier+disk", repeats=1, pool_floor=1.05,
                   tier_factor=1.25, llama_pools="0.25"),
}  # fmt: skip

# Engine counters whose difference over a run is reported (besides every "*_total" one); the
# tier's, read with .get: some are newer than some engines.
COUNTERS = ("prompt_tokens", "prompt_tokens_reused", "prompt_tokens_computed",
            "recomputed_tokens", "tier_loaded_tokens", "swapped_out_blocks", "retractions",
            "evicted_blocks", "generated_tokens", "finished_requests", "steps")  # fmt: skip
TIER_COUNTERS = ("tier_written_blocks_total", "tier_loaded_tokens_total",
                 "tier_loaded_blocks_total", "tier_loaded_ahead_blocks_total",
                 "tier_dropped_tokens_total", "retained_evicted_blocks_total",
                 "disk_read_blocks_total", "disk_spilled_blocks_total")  # fmt: skip
GAUGES = ("blocks_total", "tier_blocks_total")  # sizes named "_total", not counters


@dataclass
class Step:
    tool_s: float  # the tool's latency after this step's call
    tool_tokens: list[int]  # what the tool returns (appended after the call's output)


@dataclass
class Agent:
    task: list[int]
    steps: list[Step]  # the last step's tool is never run: its call is the answer
    start_s: float


@dataclass
class ChatStep:
    tool_s: float
    observation: str  # the next user message ("Observation: ...")


@dataclass
class ChatAgent:
    task: str
    steps: list[ChatStep]  # as Agent's: the last step's tool is never run
    start_s: float


# ---- traces ----------------------------------------------------------------------------------
def tool_latency(rng: random.Random, args: argparse.Namespace) -> float:
    latency = rng.lognormvariate(math.log(args.tool_median_s), args.tool_sigma)
    return min(max(latency, 0.05), args.tool_max_s)


def make_traces(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[Agent]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    agents = []
    for i in range(args.agents):
        steps = []
        for _ in range(rng.randint(args.min_steps, args.max_steps)):
            latency = tool_latency(rng, args)
            steps.append(Step(latency, tokens(rng.randint(50, args.tool_max_tokens))))
        agents.append(Agent(tokens(args.task_tokens), steps, i * args.stagger_s))
    return system, agents


def split_tokens(total: int, parts: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """``parts`` sizes in [lo, hi] summing to ``total`` (which must fit), heavy-tailed: most
    tool outputs are short, a few (a whole file, a long test log) are long."""
    if not parts * lo <= total <= parts * hi:
        raise ValueError(f"{total} tokens do not split into {parts} parts of {lo}..{hi}")
    sizes = [lo] * parts
    left = total - parts * lo
    while left > 0:
        room = [i for i in range(parts) if sizes[i] < hi]
        weights = [rng.expovariate(1.0) for _ in room]
        scale = left / sum(weights)
        given = 0
        for i, w in zip(room, weights, strict=True):
            add = min(hi - sizes[i], int(w * scale), left - given)
            sizes[i] += add
            given += add
        if given == 0:  # what rounding left over: a token at a time
            sizes[rng.choice(room)] += 1
            given = 1
        left -= given
    return sizes


def make_coding_traces(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[Agent]]:
    """Coding agents: each one's final path (its last prompt and answer) lands in
    ``ctx_min..ctx_max`` tokens over ``min_steps..max_steps`` turns, tool outputs of
    ``tool_min_tokens..tool_max_tokens``; the system prompt is shared."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    agents = []
    for i in range(args.agents):
        turns = rng.randint(args.min_steps, args.max_steps)
        task = tokens(args.task_tokens)
        fixed = len(system) + len(task) + turns * args.step_tokens
        tools = turns - 1  # the last turn's call is the answer: no tool after it
        lo = max(args.ctx_min, fixed + tools * args.tool_min_tokens)
        hi = min(args.ctx_max, fixed + tools * args.tool_max_tokens)
        if lo > hi:
            raise ValueError(f"no context of {args.ctx_min}..{args.ctx_max} tokens fits {turns} "
                             f"turns of {args.tool_min_tokens}..{args.tool_max_tokens}-token "
                             f"tool outputs")  # fmt: skip
        sizes = split_tokens(rng.randint(lo, hi) - fixed, tools, args.tool_min_tokens,
                             args.tool_max_tokens, rng)  # fmt: skip
        steps = [Step(tool_latency(rng, args), tokens(n)) for n in sizes]
        steps.append(Step(tool_latency(rng, args), []))
        agents.append(Agent(task, steps, i * args.stagger_s))
    return system, agents


# Plain English words for the chat traffic's text: the same words for every seed, so the text
# (and its token count) depends on the seed alone, never on a dictionary installed or not.
_WORDS_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more
can out up about into than them only other its time new some could these two may first then
do any like my now over such our man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being under
never day same another know while last might great old year off come since against go came
right used take three small found thought went say part once general high upon school every
point hand house file test error value report team system agent task tool search result query
data record change build check plan step answer issue branch function module class method line
output input request server client cache memory table index order price user account message
"""
WORDS = tuple(_WORDS_TEXT.split())


def words_text(rng: random.Random, n: int) -> str:
    """``n`` words as sentences of 6..14 words (capitalised, full stops)."""
    out: list[str] = []
    while len(out) < n:
        sentence = [rng.choice(WORDS) for _ in range(min(rng.randint(6, 14), n - len(out)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out += sentence
    return " ".join(out)


def make_chat_traces(args: argparse.Namespace) -> tuple[str, list[ChatAgent]]:
    """The chat traffic: a shared system prompt of ``system_words`` words, per agent a task of
    ``task_words`` words and ``min_steps..max_steps`` steps whose observations have
    ``obs_min_words..obs_max_words`` words after ``Observation:``."""
    rng = random.Random(args.seed)
    system = "You are a research agent of a team. " + words_text(rng, args.system_words)
    agents = []
    for i in range(args.agents):
        task = f"Task {i}: " + words_text(rng, args.task_words)
        steps = []
        for _ in range(rng.randint(args.min_steps, args.max_steps)):
            words = rng.randint(args.obs_min_words, args.obs_max_words)
            observation = "Observation: " + words_text(rng, words)
            steps.append(ChatStep(tool_latency(rng, args), observation))
        agents.append(ChatAgent(task, steps, i * args.stagger_s))
    return system, agents


def chat_messages(system: str, agent: ChatAgent, replies: Sequence[str]) -> list[dict[str, str]]:
    """The conversation an agent sends after ``replies`` (one per step done)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": agent.task}]
    for reply, step in zip(replies, agent.steps, strict=False):
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": step.observation}]  # fmt: skip
    return messages


def working_set_tokens(system: list[int], agents: list[Agent], step_tokens: int) -> int:
    """Every agent's final path, the shared system prompt once."""
    total = len(system)
    for a in agents:
        total += len(a.task) + sum(step_tokens + len(s.tool_tokens) for s in a.steps[:-1])
        total += step_tokens
    return total


class Trie:
    """Distinct token prefixes of the prompts sent (the optimum's count)."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.nodes = 0

    def add(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                self.nodes += 1
            node = child


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# ---- driving the agents ----------------------------------------------------------------------
def run_agents(
    agents: Sequence[Any], body: Callable[[int, Any], None]
) -> tuple[list[float], float]:
    """``body(i, agent)`` on a thread per agent, each started at its ``start_s``: the job
    completion times (from the agent's start) and the run's wall time."""
    jct = [0.0] * len(agents)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def run(i: int, agent: Any) -> None:
        time.sleep(agent.start_s)
        started = time.perf_counter()
        try:
            body(i, agent)
        except BaseException as e:
            errors.append(e)
        jct[i] = time.perf_counter() - started

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return jct, time.perf_counter() - t0


def drive(agents: list[Agent], system: list[int], call: Any, done: Any = None) -> dict[str, Any]:
    """Run every agent on its own thread: ``call(i, prompt) -> output ids``; returns the job
    completion times, the prompts sent and the outputs."""
    sent: list[list[int]] = []
    generated = 0
    lock = threading.Lock()

    def body(i: int, agent: Agent) -> None:
        nonlocal generated
        prompt = system + agent.task
        for k, step in enumerate(agent.steps):
            out = call(i, prompt)
            with lock:
                sent.append(list(prompt))
                generated += len(out)
            if k == len(agent.steps) - 1:
                break
            time.sleep(step.tool_s)
            prompt = prompt + list(out) + step.tool_tokens
        if done is not None:
            done(i)

    jct, seconds = run_agents(agents, body)
    return {"jct": jct, "sent": sent, "generated": generated, "seconds": seconds}


def optimum(sent: list[list[int]], step_tokens: int, calls_followed: int) -> int:
    trie = Trie()
    for prompt in sent:
        trie.add(prompt)
    # Each call that another call extends: its output's KV (all but its last token) was
    # computed while decoding.
    return trie.nodes - calls_followed * (step_tokens - 1)


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The engine's cumulative counters over a run; the tier's ones always there (0 on an
    engine that does not count them)."""
    keys = [k for k, v in after.items() if isinstance(v, int | float) and not isinstance(v, bool)
            and (k.endswith("_total") or k in COUNTERS) and k not in GAUGES]  # fmt: skip
    delta = {k: after[k] - before.get(k, 0) for k in keys}
    for k in TIER_COUNTERS:
        delta.setdefault(k, 0)
    return delta


# ---- engines ---------------------------------------------------------------------------------
class SkipConfig(Exception):
    """A configuration this engine cannot run (a setting it does not have)."""


def engine_settings(config: str, num_blocks: int, ws_bytes: int, args: argparse.Namespace,
                    scratch: Path | None) -> dict[str, Any]:  # fmt: skip
    settings: dict[str, Any] = {"num_blocks": num_blocks, "dtype": args.dtype}
    if args.model:
        settings["model"] = args.model
    if "tier" in config:
        settings["host_tier_memory"] = str(int(args.tier_factor * ws_bytes))
    if config.endswith("disk"):
        # A small host tier with the disk tier under it: most evicted paths go to files.
        settings["host_tier_memory"] = str(int(args.disk_host_share * ws_bytes))
        settings["disk_tier_size"] = str(int(args.disk_factor * ws_bytes))
        settings["cache_dir"] = str(scratch)
    if config.endswith("program"):
        settings["schedule_policy"] = "program"
    if config.endswith("fcfs"):
        settings["schedule_policy"] = "fcfs"
    return settings


def start_engine(settings: dict[str, Any]) -> Engine:
    try:
        return Engine(**settings)
    except TypeError as e:  # Engine refuses an unknown setting before loading anything
        if "disk_tier_size" in str(e):
            raise SkipConfig(f"this engine has no disk tier setting ({e})") from None
        raise


def scratch_dir(args: argparse.Namespace) -> Path:
    """A fresh folder for a disk tier's files (on a real disk: not /dev/shm)."""
    root = Path(args.disk_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="disk-tier-", dir=root))


def run_radixlang(config: str, num_blocks: int, ws_bytes: int, system: list[int],
                  agents: list[Agent], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    retain = config != "plain"
    scratch = scratch_dir(args) if config.endswith("disk") else None
    try:
        engine = start_engine(engine_settings(config, num_blocks, ws_bytes, args, scratch))
        sampling = {"max_new_tokens": args.step_tokens, "temperature": 0, "ignore_eos": True}

        def call(i: int, prompt: list[int]) -> list[int]:
            request = GenerateRequest(input_ids=prompt, sampling=dict(sampling),
                                      routing_key=f"agent-{i}",
                                      retain_s=args.retain_s if retain else 0.0)  # fmt: skip
            return engine.submit(request).result().output_ids

        def done(i: int) -> None:
            if retain:
                engine.release_retained(f"agent-{i}")

        try:
            engine.generate(system[:8], {"max_new_tokens": 2})  # warm-up: threads, kernels
            engine.flush_cache()
            engine.reset_stats()
            before = engine.stats()
            run = drive(agents, system, call, done)
            stats = engine.stats()
            engine.check_integrity()
        finally:
            engine.shutdown()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    computed = stats["prompt_tokens_computed"] + stats["recomputed_tokens"]
    return run | {
        "prompt_tokens_computed": computed,
        "prompt_tokens_reused": stats["prompt_tokens_reused"],
        "retractions": stats["retractions"],
        "evicted_blocks": stats["evicted_blocks"],
        "retained_evicted_blocks": stats["retained_evicted_blocks_total"],
        "tier_loaded_tokens": stats.get("tier_loaded_tokens_total", 0),
        "stats": stats_delta(before, stats),
    }


def run_chat(config: str, num_blocks: int, ws_bytes: int, system: str, agents: list[ChatAgent],
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """The chat traffic against the OpenAI-compatible server on a fresh engine of ``config``."""
    import httpx

    from radixlang.server import serve_in_thread

    retain = config != "plain"
    scratch = scratch_dir(args) if config.endswith("disk") else None
    sent: list[list[dict[str, str]]] = []
    generated = 0
    lock = threading.Lock()
    try:
        engine = start_engine(engine_settings(config, num_blocks, ws_bytes, args, scratch))
        try:
            with serve_in_thread(engine) as server, httpx.Client(
                base_url=server.url, timeout=600.0, trust_env=False,
                limits=httpx.Limits(max_connections=len(agents) + 2),
            ) as client:  # fmt: skip
                model = client.get("/v1/models").json()["data"][0]["id"]

                def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
                    response = client.post(path, json=body)
                    if response.status_code != 200:
                        raise RuntimeError(f"{path} {response.status_code}: {response.text[:500]}")
                    return response.json()

                def body(i: int, agent: ChatAgent) -> None:
                    nonlocal generated
                    replies: list[str] = []
                    for k, step in enumerate(agent.steps):
                        messages = chat_messages(system, agent, replies)
                        out = post("/v1/chat/completions", {
                            "model": model, "messages": messages,
                            "max_tokens": args.step_tokens, "temperature": 0,
                            "ignore_eos": True, "routing_key": f"agent-{i}",
                            "retain_s": args.retain_s if retain else 0.0})  # fmt: skip
                        with lock:
                            sent.append(messages)
                            generated += out["usage"]["completion_tokens"]
                        replies.append(out["choices"][0]["message"]["content"] or "")
                        if k == len(agent.steps) - 1:
                            break
                        time.sleep(step.tool_s)
                    if retain:
                        post("/release_program", {"routing_key": f"agent-{i}"})

                warm = [{"role": "user", "content": "Hello."}]  # threads, kernels, template
                post("/v1/chat/completions", {"model": model, "messages": warm, "max_tokens": 2})
                post("/flush_cache", {})
                engine.reset_stats()
                before = client.get("/get_server_info").json()["stats"]
                jct, seconds = run_agents(agents, body)
                stats = client.get("/get_server_info").json()["stats"]
            engine.check_integrity()
            # The prompts as the server renders them: the trie of their token ids.
            trie = Trie()
            for messages in sent:
                trie.add(chat_prompt_ids(engine.tokenizer, messages))
        finally:
            engine.shutdown()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    delta = stats_delta(before, stats)
    return {
        "jct": jct,
        "seconds": seconds,
        "generated": generated,
        "distinct_prompt_tokens": trie.nodes,
        "prompt_tokens_computed": delta["prompt_tokens_computed"] + delta["recomputed_tokens"],
        "prompt_tokens_reused": delta["prompt_tokens_reused"],
        "retractions": delta["retractions"],
        "evicted_blocks": delta["evicted_blocks"],
        "retained_evicted_blocks": delta["retained_evicted_blocks_total"],
        "tier_loaded_tokens": delta["tier_loaded_tokens_total"],
        "stats": delta,
    }


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation's prompt as the server's chat route makes it (template, then encode
    without adding special tokens again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_working_set(tokenizer: Any, system: str, agents: list[ChatAgent], step_tokens: int,
                     block_size: int) -> tuple[int, int]:  # fmt: skip
    """The chat traffic's working set and longest path in tokens, estimated: each agent's final
    conversation rendered with ``step_tokens``-word replies, the system prompt's tokens once,
    and per call the blocks its end leaves behind (measured: two blocks a call stay cached
    where the next prompt goes on in blocks of its own; short replies make that a large share
    of the paths)."""
    shared = len(chat_prompt_ids(tokenizer, [{"role": "system", "content": system}]))
    reply = " ".join(["ok"] * step_tokens)
    paths = [len(chat_prompt_ids(tokenizer, chat_messages(system, a, [reply] * (len(a.steps) - 1))))
             + step_tokens for a in agents]  # fmt: skip
    branches = sum(len(a.steps) for a in agents) * (step_tokens + block_size)
    return shared + sum(p - shared for p in paths) + branches, max(paths)


def run_llama_server(server: Path, gguf: Path, system: list[int], agents: list[Agent],
                     args: argparse.Namespace, slots: int = llama_cpp.SLOTS,
                     ctx_per_slot: int | None = None,
                     cache_ram_mib: int | None = None) -> dict[str, Any]:  # fmt: skip
    import httpx

    counts = {"computed": 0, "cached": 0}
    lock = threading.Lock()
    if ctx_per_slot is None:  # each slot holds the longest agent's whole path
        longest = max(working_set_tokens(system, [a], args.step_tokens) for a in agents)
        ctx_per_slot = max(llama_cpp.CTX_PER_SLOT, -(-longest // 256) * 256)
    extra = [] if cache_ram_mib is None else ["--cache-ram", str(cache_ram_mib)]
    with llama_cpp.LlamaServer(server, gguf, ctx_per_slot=ctx_per_slot, slots=slots,
                               extra_args=extra) as srv:  # fmt: skip
        client = httpx.Client(base_url=srv.url, timeout=3600.0, trust_env=False,
                              limits=httpx.Limits(max_connections=len(agents)))  # fmt: skip

        def call(i: int, prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "n_predict": args.step_tokens, "temperature": 0,
                    "ignore_eos": True, "cache_prompt": True, "return_tokens": True,
                    **llama_cpp.NEUTRAL_SAMPLING}  # fmt: skip
            response = client.post("/completion", json=body)
            response.raise_for_status()
            out = response.json()
            with lock:
                counts["computed"] += int(llama_cpp.field(out, "timings/prompt_n", 0))
                counts["cached"] += int(llama_cpp.field(out, "timings/cache_n", 0))
            return list(out.get("tokens") or [])

        client.post("/completion", json={"prompt": system[:8], "n_predict": 2})  # warm-up
        with lock:
            counts.update(computed=0, cached=0)
        try:
            run = drive(agents, system, call)
        finally:
            client.close()
    return run | {"prompt_tokens_computed": counts["computed"],
                  "prompt_tokens_reused": counts["cached"], "slots": slots,
                  "ctx_per_slot": ctx_per_slot, "cache_ram_mib": cache_ram_mib}  # fmt: skip


# ---- the long-context model ------------------------------------------------------------------
def bench_cache() -> Path:
    """``$RADIXLANG_BENCH_CACHE`` or ``~/.cache/radixlang-bench`` (llama_cpp's root)."""
    return llama_cpp.cache_dir().parent


def long_context_model(context: int = LONG_CONTEXT) -> Path:
    """A random-weight model of the default model's exact shape with a ``context``-token
    context, written once under the bench cache and reused."""
    from radixlang.model_files import DEFAULT_MODEL, load_model_files

    folder = bench_cache() / "models" / f"{DEFAULT_MODEL}-random-{context}"
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text())["max_position_embeddings"] == context:
        return folder
    import make_random_model

    source = load_model_files(DEFAULT_MODEL).path
    print(f"writing a random-weight {DEFAULT_MODEL} with a {context}-token context to {folder}",
          file=sys.stderr)  # fmt: skip
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make_random_model.write_random_model(source, partial, {"max_position_embeddings": context})
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def long_context_gguf(folder: Path) -> Path:
    """The F32 GGUF of ``folder`` for llama-server (converted once, next to the others)."""
    out = llama_cpp.cache_dir() / f"{folder.name}.f32.gguf"
    if not out.is_file():
        print(f"converting {folder} to {out}", file=sys.stderr)
        llama_cpp.convert_to_gguf(folder, out, "f32")
    return out


# ---- the disk tier against recomputing -------------------------------------------------------
def disk_probe(args: argparse.Namespace, vocab: int, block_size: int,
               bytes_per_token: int) -> dict[str, Any]:  # fmt: skip
    """Time to first token of a ``--probe-tokens`` prompt computed fresh (after a flush)
    against loaded back from the disk tier, after other prompts pushed it out of a pool and a
    host tier too small to keep it."""
    n = args.probe_tokens
    rng = random.Random(args.seed + 1)
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    # Short fillers (attention costs the square of a prompt's length), together longer than
    # the pool: the least recently used path, the prompt's, goes to the host tier and on down.
    fillers = [[rng.randrange(3, vocab) for _ in range(-(-n // 4))] for _ in range(5)]
    prompt_bytes = n * bytes_per_token
    scratch = scratch_dir(args)
    settings: dict[str, Any] = {
        "num_blocks": math.ceil(1.05 * n / block_size) + 1,  # the prompt and a little
        "dtype": args.dtype,
        "host_tier_memory": str(max(prompt_bytes // 8, 4 * block_size * bytes_per_token)),
        "disk_tier_size": str(4 * prompt_bytes),
        "cache_dir": str(scratch),
    }
    if args.model:
        settings["model"] = args.model
    record: dict[str, Any] = {"prompt_tokens": n, "settings": settings}
    try:
        try:
            engine = start_engine(settings)
        except SkipConfig as e:
            print(f"disk probe skipped: {e}", file=sys.stderr)
            return record | {"skipped": str(e)}
        sampling = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}

        def first_token_s(ids: list[int]) -> float:
            t0 = time.perf_counter()
            engine.submit(GenerateRequest(input_ids=ids, sampling=dict(sampling))).result()
            return time.perf_counter() - t0

        compute_s, disk_s, deltas = [], [], []
        try:
            first_token_s(prompt[:8])  # warm-up
            for _ in range(args.probe_repeats):
                engine.flush_cache()
                compute_s.append(first_token_s(prompt))
                for filler in fillers:
                    first_token_s(filler)
                before = engine.stats()
                disk_s.append(first_token_s(prompt))
                deltas.append(stats_delta(before, engine.stats()))
        finally:
            engine.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = record | {
        "compute_s": compute_s,
        "disk_load_s": disk_s,
        "compute_s_median": statistics.median(compute_s),
        "disk_load_s_median": statistics.median(disk_s),
        "compute_over_disk": statistics.median(compute_s) / statistics.median(disk_s),
        # Blocks the disk tier read back, in tokens (the engine counts blocks).
        "disk_loaded_tokens": [d.get("disk_read_blocks_total", 0) * block_size for d in deltas],
        # Whether the timed load really read the disk tier (most of the prompt from it).
        "loaded_from_disk": all(
            d.get("disk_read_blocks_total", 0) * block_size >= n // 2 for d in deltas
        ),
        "tier_loaded_tokens": [d.get("tier_loaded_tokens_total", 0) for d in deltas],
        "reused_tokens": [d.get("prompt_tokens_reused", 0) for d in deltas],
        "computed_tokens": [d.get("prompt_tokens_computed", 0) for d in deltas],
        "stats": deltas,
    }
    print(f"disk probe, {n} tokens: computed {result['compute_s_median']:.2f} s, loaded from "
          f"disk {result['disk_load_s_median']:.2f} s ({result['compute_over_disk']:.2f}x); "
          f"disk-loaded tokens {result['disk_loaded_tokens']}, reused "
          f"{result['reused_tokens']}", file=sys.stderr)  # fmt: skip
    if not result["loaded_from_disk"]:
        print(
            "disk probe: the engine did not count the prompt as loaded from its disk tier "
            "(disk_read_blocks_total): the second time is not a disk load",
            file=sys.stderr,
        )
    return result


# ---- reporting -------------------------------------------------------------------------------
_ENGINE_COUNTS = ("retractions", "evicted_blocks", "retained_evicted_blocks", "tier_loaded_tokens")


def summary(run: dict[str, Any], optimum_tokens: int) -> dict[str, Any]:
    jct = run["jct"]
    return {
        "jct_mean_s": statistics.fmean(jct),
        "jct_p50_s": percentile(jct, 0.5),
        "jct_p99_s": percentile(jct, 0.99),
        "jct_s": sorted(jct),  # every agent's, for the tail
        "seconds": run["seconds"],
        "generated_tokens": run["generated"],
        "throughput_tokens_per_s": run["generated"] / run["seconds"],
        "prompt_tokens_computed": run["prompt_tokens_computed"],
        "prompt_tokens_reused": run["prompt_tokens_reused"],
        "computed_over_optimum": run["prompt_tokens_computed"] / optimum_tokens,
    } | {k: run[k] for k in (*_ENGINE_COUNTS, "stats", "slots", "cache_ram_mib") if k in run}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(result: dict[str, Any]) -> None:
    """Ratios within the result: each configuration's JCT over its own at the 100% pool, plain's
    and llama-server's over each configuration's, and the issue's acceptance check."""
    pools = result["pools"]
    full = pools.get("100%")
    for entry in pools.values():
        configs = entry["configs"]
        plain, llama = configs.get("plain"), configs.get("llama-server")
        for name, c in configs.items():
            med = {k: c[f"jct_{k}_s"]["median"] for k in ("mean", "p50", "p99")}
            base = full["configs"].get(name) if full else None
            if base:
                c["vs_full_pool"] = {k: med[k] / base[f"jct_{k}_s"]["median"] for k in med}
            if plain:
                c["mean_jct_vs_plain"] = plain["jct_mean_s"]["median"] / med["mean"]
                c["p99_jct_vs_plain"] = plain["jct_p99_s"]["median"] / med["p99"]
            if llama:
                c["mean_jct_llama_over"] = llama["jct_mean_s"]["median"] / med["mean"]
                c["p99_jct_llama_over"] = llama["jct_p99_s"]["median"] / med["p99"]
    target = pools.get(ACCEPTANCE["pool"], {}).get("configs", {}).get(ACCEPTANCE["config"], {})
    ratios = target.get("vs_full_pool")
    if ratios:
        result["acceptance"] = {
            **ACCEPTANCE,
            "p99_ratio": ratios["p99"],
            "mean_ratio": ratios["mean"],
            "passed": ratios["p99"] <= ACCEPTANCE["p99"] and ratios["mean"] <= ACCEPTANCE["mean"],
        }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = list(result["pools"])
    probe = result.get("disk_probe")
    probe = probe if probe and "compute_s" in probe else None
    panels = len(pools) + (probe is not None)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6 * max(panels, 1), 4.2), squeeze=False)
    for ax, pool in zip(axes[0], pools, strict=False):
        entry = result["pools"][pool]
        names = list(entry["configs"])
        means = [entry["configs"][n]["jct_mean_s"]["median"] for n in names]
        p99 = [entry["configs"][n]["jct_p99_s"]["median"] for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], means, 0.4, label="mean JCT")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99 JCT")
        ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("job completion time (s)")
        ax.set_title(f"KV pool {pool} of the working set")
        ax.legend(fontsize=8)
    if probe is not None:
        ax = axes[0][-1]
        ax.bar([0, 1], [probe["compute_s_median"], probe["disk_load_s_median"]])
        ax.set_xticks([0, 1], ["computed", "loaded from disk"])
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{probe['prompt_tokens']}-token prefix")
    fig.suptitle(f"{result['mode']}: {result.get('agents', 0)} agents, {result['cpu']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the command -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--traffic",
        choices=("tokens", "chat"),
        default="tokens",
        help="token-id calls on the engine, or chat completions over the server",
    )
    p.add_argument(
        "--traces",
        choices=("react", "coding"),
        default="react",
        help="the short ReAct traces, or long-context coding agents (16-32k)",
    )
    p.add_argument(
        "--disk-probe",
        action="store_true",
        help="time to first token of a long prefix from the disk tier vs computed",
    )
    unset = "default: per workload"
    p.add_argument("--agents", type=int, help=unset)
    p.add_argument("--min-steps", type=int, help=unset)
    p.add_argument("--max-steps", type=int, help=unset)
    p.add_argument("--system-tokens", type=int, help=unset)
    p.add_argument("--task-tokens", type=int, help=unset)
    p.add_argument("--step-tokens", type=int, default=16)
    p.add_argument("--tool-min-tokens", type=int, help="coding: " + unset)
    p.add_argument("--tool-max-tokens", type=int, help=unset)
    p.add_argument("--ctx-min", type=int, default=16384, help="coding: an agent's final path")
    p.add_argument("--ctx-max", type=int, default=LONG_CONTEXT)
    p.add_argument("--system-words", type=int, default=312, help="chat: about 350 tokens")
    p.add_argument("--task-words", type=int, default=30, help="chat")
    p.add_argument("--obs-min-words", type=int, default=100, help="chat")
    p.add_argument("--obs-max-words", type=int, default=300, help="chat")
    p.add_argument("--tool-median-s", type=float, default=0.3)
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--tool-max-s", type=float, default=3.0)
    p.add_argument("--stagger-s", type=float, default=0.1)
    p.add_argument("--retain-s", type=float, default=30.0)
    p.add_argument("--pools", help="pool sizes, fractions of the working set; " + unset)
    p.add_argument(
        "--pool-floor",
        type=float,
        help="the pool holds at least this many times the longest path; " + unset,
    )
    p.add_argument("--configs", help=f"of {', '.join(CONFIGS)}; " + unset)
    p.add_argument("--tier-factor", type=float, help="host tier / working set; " + unset)
    p.add_argument(
        "--disk-host-share",
        type=float,
        default=0.25,
        help="retain+tier+disk: host tier / working set",
    )
    p.add_argument(
        "--disk-factor", type=float, default=2.0, help="retain+tier+disk: disk tier / working set"
    )
    p.add_argument(
        "--disk-dir",
        default=str(llama_cpp.cache_dir().parent / "disk-tier"),
        help="where disk tiers' files go (a fresh folder each run, removed after)",
    )
    p.add_argument("--probe-tokens", type=int, default=16384)
    p.add_argument("--probe-repeats", type=int, default=2)
    p.add_argument("--repeats", type=int, help=unset)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--model",
        help="a model folder (default: the default model; coding: a "
        f"random-weight one of its shape with a {LONG_CONTEXT}-token context)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--llama-gguf", default="f32", help="q4_1 or f32 (the default model's)")
    p.add_argument("--llama-pools", help="pools llama-server runs at; " + unset)
    p.add_argument("--llama-slots", type=int, help="coding: default as many as the pool holds")
    p.add_argument(
        "--llama-cache-ram-mib",
        type=int,
        help="coding: llama-server's host prompt cache (default: the host tier's size)",
    )
    p.add_argument("--out", type=Path, help="default: benchmarks/results/bench_agents*.json")
    args = p.parse_args(argv)
    if args.traffic == "chat" and args.traces == "coding":
        p.error("--traffic chat runs the ReAct traces: not with --traces coding")
    args.mode = "chat" if args.traffic == "chat" else args.traces
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    unknown = set(args.configs.split(",")) - set(CONFIGS) - {""}
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}: choose of {', '.join(CONFIGS)}")
    if args.out is None:
        # --disk-probe beside the default traces: the probe alone (with the coding ones: both).
        only_probe = args.disk_probe and args.mode == "react"
        name = {"react": "bench_agents", "chat": "bench_agents_chat",
                "coding": "bench_agents_coding"}[args.mode]  # fmt: skip
        args.out = RESULTS / (("bench_agents_disk_probe" if only_probe else name) + ".json")
    return args


def pool_blocks(ws: int, longest: int, frac: float, args: argparse.Namespace,
                block_size: int) -> int:  # fmt: skip
    # Never less than the longest agent's path needs (with room for the next request's).
    return math.ceil(max(ws * frac, args.pool_floor * longest) / block_size) + 1


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    only_probe = args.disk_probe and args.mode == "react"
    if args.model is None and (args.mode == "coding" or args.disk_probe):
        args.model = str(long_context_model(max(LONG_CONTEXT, args.ctx_max)))
    probe = Engine(num_blocks=16, dtype=args.dtype, **({"model": args.model} if args.model else {}))
    vocab, block_size = probe.runner.vocab_size, probe.pool.block_size
    bytes_per_token = int(probe.runner.kv.describe()["bytes_per_token"])
    # llama-server keeps its KV in float16: its bytes per token for the same shape.
    f16_bytes_per_token = bytes_per_token // probe.runner.kv.k.element_size() * 2
    tokenizer = probe.tokenizer
    probe.shutdown()
    result: dict[str, Any] = {
        "mode": "disk-probe" if only_probe else args.mode,
        "block_size": block_size,
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1min": os.getloadavg()[0],
        "args": {k: str(v) for k, v in vars(args).items()},
        "provenance": provenance(argv),
        "kv_bytes_per_token": bytes_per_token,
        "model": args.model or "default",
        "pools": {},
    }
    if not only_probe:
        run_workload(args, result, vocab, block_size, bytes_per_token, f16_bytes_per_token,
                     tokenizer)  # fmt: skip
    if args.disk_probe:
        result["disk_probe"] = disk_probe(args, vocab, block_size, bytes_per_token)
    compare(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({pool: {n: {k: round(v["median"], 3) if isinstance(v, dict) and "median" in v
                                 else v for k, v in c.items()}
                             for n, c in e["configs"].items()}
                      for pool, e in result["pools"].items()}, indent=1, default=str))  # fmt: skip
    if "acceptance" in result:
        a = result["acceptance"]
        print(f"acceptance ({a['config']} at {a['pool']} vs 100%): p99 {a['p99_ratio']:.3f}x "
              f"(<= {a['p99']}), mean {a['mean_ratio']:.3f}x (<= {a['mean']}): "
              f"{'passed' if a['passed'] else 'FAILED'}", file=sys.stderr)  # fmt: skip
    return result


def run_workload(args: argparse.Namespace, result: dict[str, Any], vocab: int, block_size: int,
                 bytes_per_token: int, f16_bytes_per_token: int,
                 tokenizer: Any) -> None:  # fmt: skip
    chat = args.mode == "chat"
    if chat:
        chat_system, chat_agents = make_chat_traces(args)
        ws, longest = chat_working_set(tokenizer, chat_system, chat_agents, args.step_tokens,
                                       block_size)  # fmt: skip
        agents_n, steps_n = len(chat_agents), sum(len(a.steps) for a in chat_agents)
        calls_followed = 0
        result["system_prompt_tokens"] = len(
            chat_prompt_ids(tokenizer, [{"role": "system", "content": chat_system}])
        )
        result["traces"] = {
            "tool_s": [s.tool_s for a in chat_agents for s in a.steps[:-1]],
            "observation_words": [len(s.observation.split()) - 1
                                  for a in chat_agents for s in a.steps[:-1]]}  # fmt: skip
        print(f"chat traffic: {agents_n} agents x {steps_n // max(agents_n, 1)} steps, system "
              f"prompt {result['system_prompt_tokens']} tokens, working set ~{ws} tokens",
              file=sys.stderr)  # fmt: skip
    else:
        make = make_coding_traces if args.mode == "coding" else make_traces
        system, agents = make(args, vocab)
        ws = working_set_tokens(system, agents, args.step_tokens)
        longest = max(working_set_tokens(system, [a], args.step_tokens) for a in agents)
        agents_n, steps_n = len(agents), sum(len(a.steps) for a in agents)
        calls_followed = sum(len(a.steps) - 1 for a in agents)
        paths = [working_set_tokens(system, [a], args.step_tokens) for a in agents]
        # What a server that caches nothing computes: every prompt whole.
        sent = sum(len(system) + len(a.task) + sum(args.step_tokens + len(s.tool_tokens)
                                                   for s in a.steps[:k])
                   for a in agents for k in range(len(a.steps)))  # fmt: skip
        result["traces"] = {"tool_s": [s.tool_s for a in agents for s in a.steps[:-1]],
                            "tool_tokens": [len(s.tool_tokens) for a in agents
                                            for s in a.steps[:-1]],
                            "paths": paths, "prompt_tokens_sent": sent}  # fmt: skip
        print(f"{args.mode} traces: {agents_n} agents, {steps_n} calls, paths {min(paths)}.."
              f"{max(paths)} tokens; working set {ws} tokens (the optimum computes about "
              f"that), prompts {sent} tokens in all (what caching nothing computes)",
              file=sys.stderr)  # fmt: skip
    result |= {"agents": agents_n, "steps": steps_n, "working_set_tokens": ws}
    configs = [c for c in args.configs.split(",") if c]
    server = gguf = None
    llama_pools = {float(f) for f in args.llama_pools.split(",") if f}
    if args.llama_cpp != "off" and llama_pools and not chat:
        try:
            server = llama_cpp.find_server(None)
            if args.mode == "coding":
                gguf = long_context_gguf(Path(args.model))
            else:
                gguf = llama_cpp.find_gguf(args.llama_gguf)
        except llama_cpp.LlamaCppMissing as e:
            if args.llama_cpp == "on":
                raise SystemExit(f"--llama-cpp on: {e}") from e
            print(f"llama-server baseline skipped: {e}", file=sys.stderr)
            server = None
    ws_bytes = ws * bytes_per_token
    skipped: dict[str, str] = {}
    for frac in (float(f) for f in args.pools.split(",")):
        num_blocks = pool_blocks(ws, longest, frac, args, block_size)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        llama_runs: list[dict[str, Any]] = []
        opt = None
        effective = num_blocks * block_size / ws
        if args.pool_floor * longest > ws * frac:  # the floor, not the fraction, sized it
            print(f"pool {frac:.0%}: {effective:.0%} of the working set (the longest path "
                  f"needs it); more agents would make it {frac:.0%}", file=sys.stderr)  # fmt: skip
        for rep in range(args.repeats):
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for config in order:
                if config in skipped:
                    continue
                try:
                    if chat:
                        run = run_chat(config, num_blocks, ws_bytes, chat_system, chat_agents,
                                       args)  # fmt: skip
                    else:
                        run = run_radixlang(config, num_blocks, ws_bytes, system, agents, args)
                except SkipConfig as e:
                    print(f"{config} skipped: {e}", file=sys.stderr)
                    skipped[config] = str(e)
                    continue
                if opt is None:
                    opt = (run["distinct_prompt_tokens"] if chat
                           else optimum(run["sent"], args.step_tokens, calls_followed))  # fmt: skip
                runs[config].append(summary(run, opt))
                s = runs[config][-1]
                print(f"pool {frac:.0%} {config:22s} mean JCT {s['jct_mean_s']:6.2f} s  p99 "
                      f"{s['jct_p99_s']:6.2f} s  computed/optimum "
                      f"{s['computed_over_optimum']:.2f}  {s['throughput_tokens_per_s']:.0f} tok/s"
                      f"  tier loaded {s['stats'].get('tier_loaded_tokens_total', 0)} tokens",
                      file=sys.stderr)  # fmt: skip
            if server is not None and frac in llama_pools:
                kw: dict[str, Any] = {}
                if args.mode == "coding":
                    ctx = LONG_CONTEXT
                    slots = args.llama_slots or max(1, round(num_blocks * block_size / ctx))
                    mib = args.llama_cache_ram_mib or math.ceil(
                        args.tier_factor * ws * f16_bytes_per_token / 2**20
                    )
                    if not llama_cpp.supports_flag(server, "--cache-ram"):
                        print("this llama-server has no --cache-ram: its default prompt cache",
                              file=sys.stderr)  # fmt: skip
                        mib = None
                    kw = {"slots": slots, "ctx_per_slot": ctx, "cache_ram_mib": mib}
                run = run_llama_server(server, gguf, system, agents, args, **kw)
                if opt is None:
                    opt = optimum(run["sent"], args.step_tokens, calls_followed)
                llama_runs.append(summary(run, opt))
                s = llama_runs[-1]
                print(f"           llama-server           mean JCT {s['jct_mean_s']:6.2f} s  p99 "
                      f"{s['jct_p99_s']:6.2f} s  computed/optimum "
                      f"{s['computed_over_optimum']:.2f}", file=sys.stderr)  # fmt: skip
        runs = {c: rs for c, rs in runs.items() if rs}
        entry: dict[str, Any] = {"num_blocks": num_blocks, "pool_fraction": effective,
                                 "optimum_prompt_tokens": opt, "configs": {},
                                 "runs": runs}  # fmt: skip
        all_runs = dict(runs) | ({"llama-server": llama_runs} if llama_runs else {})
        for name, rs in all_runs.items():
            entry["configs"][name] = {
                key: spread([r[key] for r in rs])
                for key in ("jct_mean_s", "jct_p50_s", "jct_p99_s", "throughput_tokens_per_s",
                            "computed_over_optimum", "prompt_tokens_computed")
            }  # fmt: skip
            if all("stats" in r for r in rs):  # radixlang's (llama-server has no tier counts)
                for key in ("tier_loaded_blocks", "tier_loaded_ahead_blocks"):
                    entry["configs"][name][key] = spread([r["stats"][f"{key}_total"] for r in rs])
        if llama_runs:
            entry["llama_server_runs"] = llama_runs
        result["pools"][f"{frac:.0%}"] = entry
    if skipped:
        result["skipped"] = skipped


if __name__ == "__main__":
    main()
