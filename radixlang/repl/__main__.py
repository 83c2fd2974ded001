"""``python -m radixlang.repl``: the REPL on its own, with the engine options it needs."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from radixlang.repl import add_arguments, main


@dataclass
class EngineOptions:
    dtype: str | None = None
    kv_memory: str | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


def run() -> int:
    parser = argparse.ArgumentParser(prog="python -m radixlang.repl", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--kv-memory", default=None, help="KV cache size, e.g. 512MiB")
    args = parser.parse_args()
    return main(args, EngineOptions(args.dtype, args.kv_memory))


if __name__ == "__main__":
    sys.exit(run())
