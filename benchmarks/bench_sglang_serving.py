"""SGLang's own serving benchmark client (``bench_serving --backend sglang``) against radixlang.

One command:  .venv/bin/python benchmarks/bench_sglang_serving.py [--quick] [--model NAME]
Writes benchmarks/results/bench_sglang_serving.json and .png; exits 1 if any request failed.

``radixlang serve`` runs as a subprocess on a free loopback port. Once it answers ``/health``,
SGLang 0.5.23's client, ``python -m sglang.bench_serving --backend sglang`` (through
``benchmarks/sglang_client.py``, which stands in for the GPU-side packages its imports reach but
it never runs), is run once per dataset in a subprocess of its own, as a user would run it:

- ``random-ids``: prompts of random token ids (decoded to text), random lengths;
- ``generated-shared-prefix``: groups of prompts that share a long random system prompt, the
  prefix-cache workload;
- ``random``: prompts cut from (or repeated up to) ShareGPT-format conversations to random
  lengths. ShareGPT itself would be downloaded: a small synthetic file in its format is
  written to the run's temporary folder and passed with ``--dataset-path``.

Each run sends one warm-up request, has the server flush its prefix cache (``--flush-cache``,
SGLang's ``POST /flush_cache``: every dataset starts cold, whatever ran before), then sends
every prompt at once (``--request-rate inf``), streamed, greedy, EOS ignored (the client's
defaults), with the served model's folder as ``--tokenizer``. Nothing is fetched
(``HF_HUB_OFFLINE=1``). The client runs with ``HOME`` in the run's temporary folder: it caches
generated-shared-prefix prompts under ``~/.cache/sglang/benchmark`` keyed by the seed, the
lengths and the tokenizer's class name (not its vocabulary), so a cache left by another
tokenizer would be read back.

Per dataset, from the client's own ``--output-file`` (JSONL, ``--output-details``): requests
sent, completed and failed (with the first distinct errors), throughput (requests/s, input,
output and total tokens/s), TTFT, ITL, TPOT and end-to-end latency (median and p99), and the
output lengths the server reported. From the server's ``/metrics``, read before and after each
run: its HTTP responses by route and status code (``refused``: ``/generate`` answers that were
not 200, the warm-up included), its finished requests by reason and its prompt tokens computed
vs reused from the cache. A dataset is ``ok`` when the client exited 0, every request
completed, none was refused, and each generated as many tokens as it asked for (EOS is
ignored); the command exits 1 unless every dataset is ok.

``--quick``: a smoke test, 4 prompts per dataset with short prompts and outputs on a tiny
random-weight model that speaks the default model's tokenizer (built in a temporary folder
unless ``--model`` names one).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from provenance import provenance

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.server import metrics

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLIENT = HERE / "sglang_client.py"
HOST = "127.0.0.1"
DATASETS = ("random-ids", "generated-shared-prefix", "random")

# The synthetic ShareGPT file's words.
WORDS = ("the", "river", "a", "mountain", "model", "token", "server", "request", "bright",
         "quickly", "slowly", "under", "over", "green", "blue", "cat", "dog", "data", "runs",
         "library", "tide", "volcano", "glacier", "honeybee", "printing", "circuit", "prime",
         "number", "rainbow", "heart", "music", "empire", "ocean", "question", "answer", "story",
         "garden", "winter", "summer", "light", "shadow", "stone", "bridge", "village", "market",
         "harbour", "lantern", "forest")  # fmt: skip


# ---- the server process ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``radixlang serve`` in a subprocess, its output in files (a full pipe would stall it)."""

    def __init__(self, args: argparse.Namespace, model: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.command = [
            sys.executable, "-m", "radixlang.cli", "serve", "--model", model,
            "--host", HOST, "--port", str(self.port), "--dtype", args.dtype,
            "--device", args.device, "--kv-memory", args.kv_memory, "--log-level", "warning",
        ]  # fmt: skip
        self.stdout_path, self.stderr_path = log_dir / "server.out", log_dir / "server.err"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=err, cwd=REPO, env=env)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} before answering /health:\n"
                    f"{self.stderr()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"the server did not answer /health within {timeout:.0f} s:\n{self.stderr()[-4000:]}"
        )

    def metrics(self) -> dict[str, float]:
        response = httpx.get(self.url + "/metrics", timeout=30, trust_env=False)
        response.raise_for_status()
        return metrics.parse(response.text)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (the server drains and frees every block), then wait; kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> int:
    key = metrics.PREFIX + name
    return int(after.get(key, 0.0) - before.get(key, 0.0))


def labelled_deltas(
    before: dict[str, float], after: dict[str, float], name: str
) -> dict[str, dict[str, int]]:
    """Deltas of one labelled counter, ``{first label value: {second label value: n}}``:
    ``http_requests_total`` gives ``{route: {code: n}}``."""
    prefix = f"{metrics.PREFIX}{name}{{"
    out: dict[str, dict[str, int]] = {}
    for key, value in after.items():
        if not key.startswith(prefix):
            continue
        delta = int(value - before.get(key, 0.0))
        if delta == 0:
            continue
        labels = [part.split("=", 1)[1].strip('"') for part in key[len(prefix) : -1].split(",")]
        first, second = labels[0], labels[1] if len(labels) > 1 else ""
        out.setdefault(first, {})[second] = delta
    return out


# ---- the client runs -------------------------------------------------------------------------
def write_sharegpt(path: Path, conversations: int, seed: int) -> None:
    """A synthetic file in ShareGPT's format (what the ``random`` dataset samples prompts from)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."

    data = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": text(rng.randint(20, 120))},
                {"from": "gpt", "value": text(rng.randint(20, 120))},
            ],
        }
        for i in range(conversations)
    ]
    path.write_text(json.dumps(data))


def dataset_args(args: argparse.Namespace, dataset: str, tmp: Path) -> list[str]:
    if dataset == "generated-shared-prefix":
        groups, per_group = args.gsp_groups, args.gsp_prompts_per_group
        return [
            "--num-prompts", str(groups * per_group),  # the dataset's size is groups x per group
            "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group),
            "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
            "--gsp-question-len", str(args.gsp_question_len),
            "--gsp-output-len", str(args.output_len),
        ]  # fmt: skip
    lengths = [
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio),
    ]  # fmt: skip
    if dataset == "random":
        path = tmp / "sharegpt_synthetic.json"
        if not path.exists():
            write_sharegpt(path, max(64, 2 * args.num_prompts), args.seed)
        lengths += ["--dataset-path", str(path)]
    return lengths


def client_command(
    args: argparse.Namespace, url: str, dataset: str, tokenizer: Path, model: str, out: Path,
    tmp: Path,
) -> list[str]:  # fmt: skip
    return [
        sys.executable, str(CLIENT), "--backend", "sglang", "--base-url", url,
        "--dataset-name", dataset, *dataset_args(args, dataset, tmp),
        "--model", model, "--tokenizer", str(tokenizer), "--seed", str(args.seed),
        "--request-rate", str(args.request_rate), "--output-file", str(out), "--output-details",
        "--disable-tqdm", "--flush-cache",
        *(["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []),
    ]  # fmt: skip


def client_env(home: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": str(home)}
    # requests (the client's readiness and /server_info calls) honours proxy variables.
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), HOST, "localhost"]))
    env["NO_PROXY"] = env["no_proxy"] = no_proxy
    return env


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one bench_serving result line (``--output-details``)."""
    errors = record["errors"]
    failed = [e for e in errors if e]
    distinct: list[str] = []
    for error in failed:
        if error not in distinct:
            distinct.append(error)
    output_lens = [n for n, e in zip(record["output_lens"], errors, strict=True) if not e]
    ttfts = [t * 1000 for t, e in zip(record["ttfts"], errors, strict=True) if not e]
    itls = [t * 1000 for per, e in zip(record["itls"], errors, strict=True) if not e for t in per]
    keys = (
        "duration", "completed", "total_input_tokens", "total_output_tokens",
        "total_output_tokens_retokenized", "request_throughput", "input_throughput",
        "output_throughput", "total_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "median_e2e_latency_ms",
        "p99_e2e_latency_ms", "concurrency", "max_concurrent_requests",
    )  # fmt: skip
    return {
        "requests_sent": len(errors),
        "completed": record["completed"],
        "failed": len(failed),
        "errors": [e[-2000:] for e in distinct[:5]],
        **{k: record.get(k) for k in keys},
        # recomputed from the per-request details, as a check on the client's own medians
        "ttft_ms_p50_from_details": percentile(ttfts, 50),
        "itl_ms_p50_from_details": percentile(itls, 50),
        "output_lens_min": min(output_lens, default=None),
        "output_lens_max": max(output_lens, default=None),
        "server_info_answered": record.get("server_info") is not None,
    }


def anonymous(arg: str, tmp: Path) -> str:
    """A command-line argument as recorded: the run's temporary folder and the repository's
    path replaced by placeholders, so that the JSON does not depend on where it ran."""
    return arg.replace(str(tmp), "$TMP").replace(str(REPO) + os.sep, "")


def run_dataset(
    args: argparse.Namespace, server: ServerProcess, dataset: str, tokenizer: Path, model: str,
    tmp: Path,
) -> dict[str, Any]:  # fmt: skip
    out = tmp / f"{dataset}.jsonl"
    log = tmp / f"{dataset}.client.log"
    command = client_command(args, server.url, dataset, tokenizer, model, out, tmp)
    before = server.metrics()
    start = time.perf_counter()
    with open(log, "wb") as f:
        try:
            code = subprocess.run(
                command, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=client_env(tmp),
                timeout=args.client_timeout,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    wall = time.perf_counter() - start
    after = server.metrics()
    http = labelled_deltas(before, after, "http_requests_total")
    generate = http.get("/generate", {})
    entry: dict[str, Any] = {
        "client_command": [Path(command[0]).name, *(anonymous(a, tmp) for a in command[1:])],
        "client_exit_code": code,
        "client_wall_s": wall,
        "server_http_responses": http,
        "server_generate_responses": generate,
        # /generate answers other than 200, the client's warm-up request included
        "refused": sum(n for status, n in generate.items() if status != "200"),
        "server_finished_by_reason": {
            reason: n
            for reason, counts in labelled_deltas(
                before, after, "requests_finished_by_reason_total"
            ).items()
            for n in counts.values()
        },
        "server_prompt_tokens": {
            "computed": counter_delta(before, after, "prompt_tokens_computed_total"),
            "reused": counter_delta(before, after, "prompt_tokens_cached_total"),
        },
    }
    lines = out.read_text().splitlines() if out.exists() else []
    if lines:
        entry.update(summarize(json.loads(lines[-1])))
        # EOS is ignored: every request generates the number of tokens it asked for, drawn
        # from [ratio x len, len] (generated-shared-prefix: all of them, its ratio being 1).
        ratio = 1.0 if dataset == "generated-shared-prefix" else args.range_ratio
        low, high = max(int(args.output_len * ratio), 1), args.output_len
        entry["requested_output_lens"] = [low, high]
        entry["output_lens_in_requested_range"] = (
            entry["output_lens_min"] is not None
            and low <= entry["output_lens_min"] <= entry["output_lens_max"] <= high
        )
    else:  # the client died before writing its result (all requests failed, or a crash)
        entry.update({"requests_sent": None, "completed": 0, "failed": None, "errors": []})
        entry["output_lens_in_requested_range"] = False
    entry["client_log_tail"] = log.read_text(errors="replace")[-3000:]
    entry["problems"] = problems(entry, bool(lines))
    entry["ok"] = not entry["problems"]
    return entry


def problems(entry: dict[str, Any], wrote_result: bool) -> list[str]:
    """What went wrong in one dataset's run, in words (none: the run is ok)."""
    found = []
    if entry["client_exit_code"] != 0:
        found.append(f"the client exited with {entry['client_exit_code']}")
    if not wrote_result:
        found.append("the client wrote no result")
    if entry["failed"]:
        found.append(f"{entry['failed']} requests failed")
    if entry["refused"]:
        found.append(f"the server refused {entry['refused']} requests")
    if wrote_result and not entry["completed"] == entry["requests_sent"] > 0:
        found.append(f"{entry['completed']} of {entry['requests_sent']} requests completed")
    if wrote_result and not entry["output_lens_in_requested_range"]:
        low, high = entry["requested_output_lens"]
        found.append(
            f"output lengths {entry['output_lens_min']}..{entry['output_lens_max']} outside "
            f"the requested {low}..{high} (EOS ignored)"
        )
    return found


def run(args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    files = load_model_files(model)  # a wrong name fails here, before any server starts
    tokenizer = files.path  # the served model's own folder: tokenizer files, no download
    server = ServerProcess(args, model, tmp)
    info: dict[str, Any] = {"command": [anonymous(a, tmp) for a in server.command[1:]]}
    datasets: dict[str, Any] = {}
    try:
        info["startup_s"] = server.wait_healthy(args.startup_timeout)
        print(f"radixlang serve ({files.name}) up on {server.url} after "
              f"{info['startup_s']:.1f} s", flush=True)  # fmt: skip
        for dataset in args.datasets:
            entry = run_dataset(args, server, dataset, tokenizer, str(files.path), tmp)
            datasets[dataset] = entry
            print(f"  {dataset:24s} {line(entry)}", flush=True)
            if not entry["ok"]:
                print(entry["client_log_tail"], file=sys.stderr, flush=True)
                print(f"  {dataset}: " + "; ".join(entry["problems"]), flush=True)
    finally:
        code = server.stop()
        stderr = server.stderr()
        info["exit_code"] = code
        info["stderr_tail"] = stderr[-4000:]
        errors = [ln for ln in stderr.splitlines() if ln.startswith(("ERROR", "CRITICAL"))]
        info["stderr_error_lines"] = errors
        info["clean_shutdown"] = code == 0 and not errors
    return {
        "model": files.name,
        "tokenizer": anonymous(str(tokenizer), tmp),
        "server": info,
        "datasets": datasets,
    }


def line(entry: dict[str, Any]) -> str:
    if entry.get("request_throughput") is None:
        return (f"client exit {entry['client_exit_code']}: {entry['completed']} completed, "
                f"refused {entry['refused']}")  # fmt: skip
    return (
        f"{entry['completed']}/{entry['requests_sent']} completed, {entry['failed']} failed, "
        f"{entry['refused']} refused  {entry['request_throughput']:6.2f} req/s "
        f"{entry['output_throughput']:7.1f} out tok/s  ttft p50 {entry['median_ttft_ms']:7.1f} ms"
        f"  itl p50 {entry['median_itl_ms']:6.1f} ms"
    )


# ---- report --------------------------------------------------------------------------------
def cpu_info() -> dict[str, Any]:
    """The CPU's model and its vector extensions that matter for bfloat16 on the CPU (without
    AVX-512 BF16 or AMX, torch emulates bfloat16 matmuls, several times slower than float32)."""
    info: dict[str, Any] = {"model": platform.processor() or None, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for row in text.splitlines():
        key, _, value = row.partition(":")
        if key.strip() == "model name" and not info["model"]:
            info["model"] = value.strip()
        elif key.strip() == "flags":
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            info["flags"] = [flag for flag in wanted if flag in value.split()]
            break
    return info


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["datasets"])
    entries = [result["datasets"][n] for n in names]
    xs = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))

    def bars(ax: Any, series: list[tuple[str, list[float], str]], fmt: str) -> None:
        width = 0.8 / len(series)
        for j, (label, values, color) in enumerate(series):
            offset = (j - (len(series) - 1) / 2) * width
            b = ax.bar([x + offset for x in xs], values, width, label=label, color=color)
            ax.bar_label(b, fmt=fmt, fontsize=7)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.legend(fontsize=7)

    def values(key: str) -> list[float]:
        return [e.get(key) or 0 for e in entries]

    # (label, result key, colour) per bar of a group
    requests = [("sent", "requests_sent", "C0"), ("completed", "completed", "C2"),
                ("failed", "failed", "C3"), ("refused", "refused", "C1")]  # fmt: skip
    throughput = [("output tokens / s", "output_throughput", "C0"),
                  ("total tokens / s", "total_throughput", "C1")]  # fmt: skip
    latency = [("TTFT p50", "median_ttft_ms", "C0"), ("ITL p50", "median_itl_ms", "C1"),
               ("TPOT p50", "median_tpot_ms", "C2")]  # fmt: skip
    for ax, series, fmt in ((axes[0], requests, "%d"), (axes[1], throughput, "%.0f"),
                            (axes[2], latency, "%.0f")):  # fmt: skip
        bars(ax, [(label, values(key), color) for label, key, color in series], fmt)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[0].set_title("requests (refused: /generate answers not 200, warm-up included)", fontsize=9)
    axes[1].set_title("throughput, as bench_serving measures it", fontsize=9)
    axes[2].set_ylabel("ms")
    axes[2].set_title("latency medians", fontsize=9)
    cfg = result["config"]
    fig.suptitle(
        f"sglang {result['sglang_version']} bench_serving --backend sglang against radixlang "
        f"serve: {result['model']} {cfg['dtype']} on {result['machine']['device']} "
        f"({result['machine']['cpu_count']} CPUs), request rate {cfg['request_rate']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=f"default {DEFAULT_MODEL}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-memory", default=None, help="default 1GiB (quick: 64MiB)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--num-prompts", type=int, help="random datasets (default 32, quick 4)")
    parser.add_argument("--input-len", type=int, help="random datasets (default 128, quick 32)")
    parser.add_argument("--output-len", type=int, help="every dataset (default 32, quick 8)")
    parser.add_argument(
        "--range-ratio", type=float, default=0.5, help="random lengths in [ratio x len, len]"
    )
    parser.add_argument("--gsp-groups", type=int, help="shared prefixes (default 4, quick 2)")
    parser.add_argument("--gsp-prompts-per-group", type=int, help="default 8 (quick 2)")
    parser.add_argument("--gsp-system-prompt-len", type=int, help="default 256 (quick 64)")
    parser.add_argument("--gsp-question-len", type=int, help="default 32 (quick 16)")
    parser.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 4 prompts")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--client-timeout", type=float, default=1800.0, help="per dataset, s")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    quick = args.quick
    for key, full, small in (
        ("kv_memory", "1GiB", "64MiB"), ("num_prompts", 32, 4), ("input_len", 128, 32),
        ("output_len", 32, 8), ("gsp_groups", 4, 2), ("gsp_prompts_per_group", 8, 2),
        ("gsp_system_prompt_len", 256, 64), ("gsp_question_len", 32, 16),
    ):  # fmt: skip
        if getattr(args, key) is None:
            setattr(args, key, small if quick else full)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_sglang_serving_") as tmp:
        model = args.model
        if model is None:
            if quick:
                from radixlang.testing import write_tiny_chat_model

                model = str(write_tiny_chat_model(Path(tmp) / "tiny-chat-model"))
            else:
                model = DEFAULT_MODEL
        ran = run(args, model, Path(tmp))

    entries = ran["datasets"].values()
    result: dict[str, Any] = {
        "benchmark": "bench_sglang_serving",
        "sglang_version": importlib.metadata.version("sglang"),
        "provenance": provenance(argv),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_info(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": args.device,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "model": ran["model"],
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tokenizer": ran["tokenizer"],
        "server": ran["server"],
        "datasets": ran["datasets"],
        "summary": {
            "requests_sent": sum(e["requests_sent"] or 0 for e in entries),
            "completed": sum(e["completed"] or 0 for e in entries),
            "failed": sum(e["failed"] or 0 for e in entries),
            "refused": sum(e["refused"] for e in entries),
            "all_ok": len(entries) == len(args.datasets) and all(e["ok"] for e in entries),
            "server_clean_shutdown": ran["server"]["clean_shutdown"],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench_sglang_serving.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    plot(result, json_path.with_suffix(".png"))
    s = result["summary"]
    print(
        f"{s['completed']}/{s['requests_sent']} requests completed, {s['failed']} failed, "
        f"{s['refused']} refused; server exit code {ran['server']['exit_code']} "
        f"(clean shutdown: {s['server_clean_shutdown']})"
    )
    for name, entry in ran["datasets"].items():
        if not entry["ok"]:
            print(f"NOT OK {name}: " + "; ".join(entry["problems"]))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["summary"]["all_ok"] else 1)
