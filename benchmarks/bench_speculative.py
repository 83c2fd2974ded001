"""Speculative decoding without a draft model: radixlang with drafts off and on, side by side
with llama-server without and with its own draft-less n-gram speculation.

One command:  .venv/bin/python benchmarks/bench_speculative.py [--quick]
Writes benchmarks/results/bench_speculative.json and .png.

Copy-heavy tasks, each at batch 1, 8 and 32 (that many different instances at once; for
self-consistency, that many siblings of one question), on the default model:

- extract_json: an invoice into JSON with its fields' values copied (held to a JSON schema);
- edit_code: a Python file written out again with one function renamed;
- quote_tool: a tool's log output, answered by quoting its error lines;
- self_consistency: sampled chains of thought (temperature 0.7) side by side, whose phrases
  repeat each other's.

radixlang runs one engine (speculative="ngram") whose drafter is switched off and on between
runs: two engines in one process slow each other (their CPU thread teams contend), which would
blur the ratio. Decode throughput is the generated tokens over the wall time of the batch, its
prompts cached first (radixlang: the cache flushed, then the prompts prefilled; llama-server:
the same prompts sent once with one token to predict, which fills its slots' prompt caches).
Each run of a task alternates off and on, ``--repeats`` times; the JSON has every run, the PNG
the median ratio with the spread. ``tokens per verification`` is what one verification of a
request takes: its accepted draft tokens and the token after them.

The program workloads of ``bench_programs.py`` (few-shot, self-consistency, tree of thought,
multi-turn, select) run at their own scale, off and on alternately, to show that drafting never
costs a workload more than a few percent (the cost rule drafts only what pays).

Greedy equality: every greedy task and batch, and the greedy program workloads, run again in
deterministic mode (where a token's logits are bitwise the same whether a decode step or a
verification computes them) with drafts off and on; the outputs must be equal token for token.
In the default mode a bfloat16 verification's logits may differ in the last bits from a
decode step's, as they do between batch sizes, and a near tie can go the other way.

llama-server (``bash benchmarks/setup_llama_cpp.sh`` builds it; skipped with a message when it
is missing) runs the same prompts as token ids with ``--spec-type none`` and ``ngram-simple``
(its draft-less speculation), ``-np`` slots equal to the batch, on the GGUF given by
``--llama-gguf`` (the default model's Q4_1 file by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_programs
import llama_cpp
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime.engine import Engine

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ("extract_json", "edit_code", "quote_tool", "self_consistency")
PROGRAMS = ("few_shot", "self_consistency", "tree_of_thought", "multi_turn", "select")
GREEDY_PROGRAMS = ("few_shot", "multi_turn", "select")

# ---- the tasks' text, made from a seed ----------------------------------------------------------
FIRST = ["Maria", "Tomas", "Aiko", "Farid", "Grace", "Olu", "Ines", "Pavel", "Lena", "Ravi"]
LAST = ["Lopez", "Novak", "Tanaka", "Haddad", "Okafor", "Berg", "Silva", "Ivanov", "Moreau"]
STREETS = ["Harbour Street", "Mill Lane", "Kings Road", "Elm Avenue", "Quarry Hill", "Dock Row"]
CITIES = ["Leith", "Porto", "Osaka", "Tartu", "Ghent", "Lyon", "Bergen", "Cork", "Split"]
GOODS = ["oak chairs", "walnut tables", "steel lamps", "linen curtains", "clay pots", "wool rugs"]
VERBS = ["load", "parse", "merge", "score", "clean", "split", "count", "rank", "render", "check"]
NOUNS = ["orders", "rows", "names", "prices", "events", "scores", "pages", "users", "items"]
SERVICES = ["auth", "billing", "search", "mailer", "cache", "gateway", "indexer", "scheduler"]

INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "number": {"type": "string"},
        "customer": {"type": "string"},
        "address": {"type": "string"},
        "date": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}},
        "total": {"type": "string"},
    },
    "required": ["number", "customer", "address", "date", "items", "total"],
}


def invoice(rng: random.Random) -> str:
    items = [
        f"{rng.randint(2, 40)} {rng.choice(GOODS)} at {rng.randint(5, 900)} euros each"
        for _ in range(rng.randint(2, 4))
    ]
    return (
        f"Invoice {rng.randint(1000, 9999)}\n"
        f"Customer: {rng.choice(FIRST)} {rng.choice(LAST)}\n"
        f"Address: {rng.randint(1, 99)} {rng.choice(STREETS)}, {rng.choice(CITIES)}\n"
        f"Date: {rng.randint(1, 28)} March 2026\n"
        + "".join(f"Item: {item}\n" for item in items)
        + f"Total due: {rng.randint(100, 20000)} euros"
    )


def code_file(rng: random.Random) -> tuple[str, str, str]:
    names = rng.sample([f"{v}_{n}" for v in VERBS for n in NOUNS], 4)
    parts = []
    for name in names:
        arg = name.split("_")[1]
        parts.append(
            f"def {name}({arg}):\n"
            f'    """{name.replace("_", " ").capitalize()} and return the result."""\n'
            f"    result = []\n"
            f"    for entry in {arg}:\n"
            f"        if entry is not None:\n"
            f"            result.append(entry)\n"
            f"    return result\n"
        )
    old = names[1]
    new = old.split("_")[0] + "_all_" + old.split("_")[1]
    return "\n\n".join(parts), old, new


def tool_log(rng: random.Random) -> str:
    lines = []
    for i in range(16):
        stamp, service = f"12:{i:02d}:{rng.randint(10, 59)}", rng.choice(SERVICES)
        if rng.random() < 0.3:
            request, retries = rng.randint(100, 999), rng.randint(2, 30)
            failed = f"request {request} failed after {retries} retries"
            lines.append(f"{stamp} ERROR {service}: {failed}")
        else:
            lines.append(f"{stamp} INFO {service}: handled {rng.randint(10, 500)} requests")
    return "\n".join(lines)


@dataclass
class Call:
    """One request of a task: a chat message and its sampling."""

    message: str
    params: dict[str, Any]


def task_calls(task: str, batch: int, seed: int, max_new_tokens: int) -> list[Call]:
    rng = random.Random(f"{task}/{batch}/{seed}")
    greedy = {"temperature": 0, "max_new_tokens": max_new_tokens}
    calls = []
    for _ in range(batch):
        if task == "extract_json":
            doc = invoice(rng)
            message = (
                f"{doc}\n\nWrite this invoice as JSON with the fields number, customer, "
                "address, date, items and total, copying each value exactly."
            )
            calls.append(Call(message, greedy | {"json_schema": json.dumps(INVOICE_SCHEMA)}))
        elif task == "edit_code":
            code, old, new = code_file(rng)
            message = (
                f"Here is a Python file:\n\n{code}\n\nWrite the whole file again with the "
                f"function {old} renamed to {new}. Answer with the code only."
            )
            calls.append(Call(message, greedy))
        elif task == "quote_tool":
            message = (
                f"The log tool returned:\n\n{tool_log(rng)}\n\nWhich requests failed? Quote "
                "every ERROR line exactly as the tool wrote it."
            )
            calls.append(Call(message, greedy))
        else:  # self_consistency: siblings of one question
            sampled = {"temperature": 0.7, "max_new_tokens": max_new_tokens, "ignore_eos": True}
            calls.append(Call(bench_programs.self_consistency_prompt(), sampled))
    return calls


def chat_ids(tokenizer: Any, message: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text)


# ---- radixlang ---------------------------------------------------------------------------------
@dataclass
class Run:
    seconds: float
    generated: int
    outputs: list[list[int]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "generated_tokens": self.generated,
            "tokens_per_second": self.generated / self.seconds,
            **self.stats,
        }


SPEC_STATS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_tokens_per_verify", "steps")


def run_engine(engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]) -> Run:
    """The batch on ``engine``: its prompts cached first, then timed to the last token."""
    engine.flush_cache()
    for h in [engine.submit(p, {"max_new_tokens": 0}) for p in prompts]:
        h.result()
    engine.reset_stats()
    started = time.perf_counter()
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    results = [h.result() for h in handles]
    seconds = time.perf_counter() - started
    stats = engine.stats()
    return Run(
        seconds,
        sum(len(r.output_ids) for r in results),
        [r.output_ids for r in results],
        {k: stats[k] for k in SPEC_STATS if k in stats},
    )


def make_engine(files: Any, args: argparse.Namespace, **kw: Any) -> Engine:
    return Engine(
        files,
        dtype=args.dtype,
        kv_memory=args.kv_memory,
        speculative="ngram",
        max_running_requests=64,
        threads=args.threads,
        **kw,
    )


class Switch:
    """An engine's drafts on ("ngram") or off, between runs (its drafter kept aside)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.drafter = engine.scheduler.drafter

    def __getitem__(self, mode: str) -> Engine:
        drafter = self.drafter if mode == "ngram" else None
        self.engine._call(lambda: setattr(self.engine.scheduler, "drafter", drafter))
        return self.engine

    def items(self) -> list[tuple[str, Engine]]:
        return [(mode, self[mode]) for mode in ("off", "ngram")]


def bench_tasks(files: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(files, args)
    engines = Switch(engine)
    out: dict[str, Any] = {}
    try:
        run_engine(engine, [chat_ids(tokenizer, "Hello")], [{"max_new_tokens": 8}])  # warm up
        for task in args.tasks:
            for batch in args.batches:
                calls = task_calls(task, batch, 0, args.max_new_tokens)
                prompts = [chat_ids(tokenizer, c.message) for c in calls]
                params = [c.params for c in calls]
                runs: dict[str, list[Run]] = {"off": [], "ngram": []}
                for _ in range(args.repeats):
                    for mode in ("off", "ngram"):
                        runs[mode].append(run_engine(engines[mode], prompts, params))
                entry = summarize_runs(runs)
                entry["prompt_tokens_mean"] = statistics.mean(map(len, prompts))
                entry["sample_output"] = tokenizer.decode(runs["ngram"][0].outputs[0])[:400]
                out[f"{task}/{batch}"] = entry
                print(
                    f"  {task:17s} batch {batch:2d}: off {entry['off_tokens_per_second']:6.1f} "
                    f"tok/s, on {entry['on_tokens_per_second']:6.1f} tok/s, "
                    f"x{entry['speedup']:.2f} ({entry['speedup_min']:.2f}-"
                    f"{entry['speedup_max']:.2f}), {entry['on_tokens_per_verify']:.2f} tokens "
                    "per verification",
                    flush=True,
                )
    finally:
        engine.shutdown()
    return out


def summarize_runs(runs: dict[str, list[Run]]) -> dict[str, Any]:
    off = [r.generated / r.seconds for r in runs["off"]]
    on = [r.generated / r.seconds for r in runs["ngram"]]
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    last = runs["ngram"][-1].stats
    return {
        "off_tokens_per_second": statistics.median(off),
        "on_tokens_per_second": statistics.median(on),
        "speedup": statistics.median(ratios),
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
        "on_tokens_per_verify": last.get("spec_tokens_per_verify", 0.0),
        "on_accept_rate": (
            last["spec_accepted_tokens"] / last["spec_draft_tokens"]
            if last.get("spec_draft_tokens")
            else 0.0
        ),
        "runs": {mode: [r.summary() for r in rs] for mode, rs in runs.items()},
    }


def check_equal(files: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Deterministic mode: greedy outputs with drafts equal those without, every task and
    batch."""
    engine = make_engine(files, args, deterministic=True)
    engines = Switch(engine)
    out: dict[str, Any] = {}
    try:
        for task in args.tasks:
            if task == "self_consistency":
                continue  # sampled: its distribution is tested in tests/runtime
            for batch in args.batches:
                calls = task_calls(task, batch, 0, args.max_new_tokens)
                prompts = [chat_ids(tokenizer, c.message) for c in calls]
                params = [c.params for c in calls]
                off, on = (run_engine(engines[m], prompts, params) for m in ("off", "ngram"))
                equal = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True))
                out[f"{task}/{batch}"] = {
                    "equal": equal,
                    "requests": batch,
                    "tokens": off.generated,
                    "on_tokens_per_verify": on.stats.get("spec_tokens_per_verify", 0.0),
                }
                print(f"  {task:17s} batch {batch:2d}: {equal}/{batch} equal", flush=True)
    finally:
        engine.shutdown()
    return out


# ---- bench_programs' workloads -------------------------------------------------------------------
def bench_programs_workloads(args: argparse.Namespace, deterministic: bool) -> dict[str, Any]:
    import radixlang as sgl

    scale = bench_programs.SCALES[args.program_scale]
    workloads = [bench_programs.WORKLOAD_CLASSES[name](scale) for name in args.programs]
    if deterministic:
        workloads = [w for w in workloads if w.name in GREEDY_PROGRAMS]
    rt = sgl.Runtime(
        model_path=args.model,
        dtype=args.dtype,
        kv_memory=args.kv_memory,
        speculative="ngram",
        deterministic=deterministic,
        threads=args.threads,
    )
    sgl.set_default_backend(rt)
    switch = Switch(rt.engine)
    out: dict[str, Any] = {}
    try:
        for w in workloads:
            seconds: dict[str, list[float]] = {"off": [], "ngram": []}
            answers: dict[str, Any] = {}
            stats: dict[str, Any] = {}
            for _ in range(1 if deterministic else args.repeats):
                for mode in ("off", "ngram"):
                    switch[mode]
                    run = w.program(sgl)
                    rt.flush_cache()
                    rt.engine.reset_stats()
                    started = time.perf_counter()
                    answers[mode] = run()
                    seconds[mode].append(time.perf_counter() - started)
                    stats[mode] = {k: v for k, v in rt.stats().items() if k in SPEC_STATS}
            if deterministic:
                out[w.name] = {"equal": answers["off"] == answers["ngram"], "answers": answers}
                print(f"  {w.name:17s} equal: {out[w.name]['equal']}", flush=True)
                continue
            ratios = [a / b for a, b in zip(seconds["off"], seconds["ngram"], strict=True)]
            out[w.name] = {
                "off_seconds": seconds["off"],
                "on_seconds": seconds["ngram"],
                "speedup": statistics.median(ratios),
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
                "on_stats": stats["ngram"],
            }
            print(
                f"  {w.name:17s} off {statistics.median(seconds['off']):6.2f} s, on "
                f"{statistics.median(seconds['ngram']):6.2f} s: x{out[w.name]['speedup']:.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})",
                flush=True,
            )
    finally:
        rt.shutdown()
    return out


# ---- llama-server ---------------------------------------------------------------------------
def llama_body(prompt: list[int], params: dict[str, Any], n_predict: int, seed: int) -> dict:
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "cache_prompt": True,
        "temperature": params.get("temperature", 0),
        "ignore_eos": params.get("ignore_eos", False),
        "seed": seed,
        **llama_cpp.NEUTRAL_SAMPLING,
    }
    if "json_schema" in params:
        body["json_schema"] = json.loads(params["json_schema"])
    return body


def bench_llama(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    try:
        binary = llama_cpp.find_server(None)
        gguf = llama_cpp.find_gguf(args.llama_gguf)
    except llama_cpp.LlamaCppMissing as e:
        print(f"  llama-server skipped: {e}", flush=True)
        return {"skipped": str(e)}
    out: dict[str, Any] = {
        "gguf": str(gguf),
        "version": llama_cpp.server_version(binary),
        "repeats": args.llama_repeats,
    }
    for batch in args.batches:
        seconds: dict[str, dict[str, list[float]]] = {}
        tokens: dict[str, dict[str, list[int]]] = {}
        for spec in ("none", "ngram-simple"):
            extra = ["--spec-type", spec]
            with llama_cpp.LlamaServer(binary, gguf, slots=batch, extra_args=extra) as server:
                client = httpx.Client(base_url=server.url, timeout=600.0, trust_env=False)
                pool = ThreadPoolExecutor(max_workers=batch)

                def post(body: dict, client: httpx.Client = client) -> dict:
                    r = client.post("/completion", json=body)
                    r.raise_for_status()
                    return r.json()

                for task in args.tasks:
                    calls = task_calls(task, batch, 0, args.max_new_tokens)
                    prompts = [chat_ids(tokenizer, c.message) for c in calls]
                    for _ in range(args.llama_repeats):
                        warm = [llama_body(p, {}, 1, 0) for p in prompts]
                        list(pool.map(post, warm))
                        bodies = [
                            llama_body(p, c.params, args.max_new_tokens, i)
                            for i, (p, c) in enumerate(zip(prompts, calls, strict=True))
                        ]
                        started = time.perf_counter()
                        responses = list(pool.map(post, bodies))
                        elapsed = time.perf_counter() - started
                        made = sum(int(r.get("tokens_predicted", 0)) for r in responses)
                        seconds.setdefault(task, {}).setdefault(spec, []).append(elapsed)
                        tokens.setdefault(task, {}).setdefault(spec, []).append(made)
                pool.shutdown()
                client.close()
        for task in args.tasks:
            rates = {
                spec: [n / s for n, s in zip(tokens[task][spec], seconds[task][spec], strict=True)]
                for spec in ("none", "ngram-simple")
            }
            ratios = [b / a for a, b in zip(rates["none"], rates["ngram-simple"], strict=True)]
            out[f"{task}/{batch}"] = {
                "none_tokens_per_second": statistics.median(rates["none"]),
                "ngram_tokens_per_second": statistics.median(rates["ngram-simple"]),
                "speedup": statistics.median(ratios),
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
            }
            e = out[f"{task}/{batch}"]
            print(
                f"  {task:17s} batch {batch:2d}: llama-server none "
                f"{e['none_tokens_per_second']:6.1f} tok/s, ngram-simple "
                f"{e['ngram_tokens_per_second']:6.1f} tok/s, x{e['speedup']:.2f}",
                flush=True,
            )
    return out


def reused_llama(earlier: dict[str, Any], path: Path) -> dict[str, Any]:
    """llama-server's part of an earlier run (``--llama-from``), marked as such."""
    if "llama_server" not in earlier:
        raise SystemExit(f"{path} has no llama_server part")
    part = dict(earlier["llama_server"])
    part["reused_from"] = {"file": str(path), "commit": earlier.get("commit")}
    for key, entry in part.items():
        if "/" in key:
            print(f"  {key:20s} (reused) x{entry['speedup']:.2f}", flush=True)
    return part


# ---- the plot ------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    llama = result.get("llama_server", {})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5), width_ratios=[3, 1])
    keys = list(tasks)
    x = range(len(keys))
    ours = [tasks[k]["on_tokens_per_second"] for k in keys]
    theirs = [llama.get(k, {}).get("ngram_tokens_per_second", 0.0) for k in keys]
    plain = [tasks[k]["off_tokens_per_second"] for k in keys]
    width = 0.28
    ax.bar([i - width for i in x], plain, width, label="radixlang, drafts off")
    ax.bar(list(x), ours, width, label="radixlang, drafts on")
    ax.bar([i + width for i in x], theirs, width, label="llama-server ngram-simple")
    for i, k in enumerate(keys):
        label = f"x{tasks[k]['speedup']:.2f}"
        ax.annotate(label, (i, ours[i]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), keys, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens / s")
    ax.set_title("copy-heavy tasks (task/batch); label: radixlang on / off")
    ax.legend(fontsize=8)
    programs = result.get("programs", {})
    names = list(programs)
    speed = [programs[n]["speedup"] for n in names]
    low = [programs[n]["speedup"] - programs[n]["speedup_min"] for n in names]
    high = [programs[n]["speedup_max"] - programs[n]["speedup"] for n in names]
    bx.bar(range(len(names)), speed, yerr=[low, high], capsize=3)
    bx.axhline(1.0, color="gray", lw=0.8)
    bx.axhline(0.97, color="red", lw=0.8, ls="--")
    bx.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    bx.set_title("bench_programs: time off / on")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="the engine's CPU threads, fixed (the default adapts them to what other processes "
        "use, which would change a run's speed midway)",
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--programs", nargs="*", default=list(PROGRAMS), choices=PROGRAMS)
    parser.add_argument("--program-scale", default="full", choices=sorted(bench_programs.SCALES))
    parser.add_argument("--no-equality", action="store_true", help="skip the deterministic check")
    parser.add_argument("--llama-cpp", default="auto", choices=["auto", "off"])
    parser.add_argument("--llama-gguf", default="q4_1")
    parser.add_argument(
        "--llama-repeats",
        type=int,
        default=1,
        help="repeats of each llama-server run (its ngram-simple arm at batch 32 takes minutes)",
    )
    parser.add_argument(
        "--llama-from",
        type=Path,
        help="take llama-server's part from this earlier result file instead of running it "
        "(it does not depend on radixlang's code; recorded as reused)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, one repeat, short")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_speculative.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.repeats, args.max_new_tokens = [1, 8], 1, 64
        args.program_scale = "small"
    files = load_model_files(args.model)
    tokenizer = files.load_tokenizer()
    load_before = os.getloadavg()
    record = provenance(argv)
    result: dict[str, Any] = {
        "benchmark": "bench_speculative",
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "model": files.name,
        # The checkout's commit, "+changes" when its tracked files differ (--llama-from reads it).
        "commit": record["commit"] and record["commit"] + ("+changes" if record["dirty"] else ""),
        "provenance": record,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("tasks", lambda: bench_tasks(files, tokenizer, args)),
    ]
    if args.programs:
        steps.append(("programs", lambda: bench_programs_workloads(args, deterministic=False)))
    if not args.no_equality:
        steps.append(("greedy_equal", lambda: check_equal(files, tokenizer, args)))
        if args.programs:
            steps.append(("greedy_equal_programs", lambda: bench_programs_workloads(args, True)))
    if args.llama_from is not None:
        # Read now: the file may be the one this run writes after each part.
        earlier = json.loads(args.llama_from.read_text())
        steps.append(("llama_server", lambda: reused_llama(earlier, args.llama_from)))
    elif args.llama_cpp != "off":
        steps.append(("llama_server", lambda: bench_llama(tokenizer, args)))
    result["machine"]["loadavg_before"] = load_before
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, step in steps:
        print(f"{name}:", flush=True)
        result[name] = step()
        # Written after every part: a long run stopped midway keeps what it measured.
        result["machine"]["loadavg_after"] = os.getloadavg()
        args.out.write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
