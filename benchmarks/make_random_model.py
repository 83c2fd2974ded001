"""Write a random-weight model with another model folder's architecture and tokenizer.

For timing where the real weights are not installed (a lent GPU machine), or where a longer
context than the real model's is needed (bench_agents' coding traces): speed does not depend
on the weights' values, and the benchmarks ignore EOS.

    python benchmarks/make_random_model.py SOURCE_FOLDER DEST_FOLDER [--max-position-embeddings N]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch


def write_random_model(
    source: str | Path, dest: str | Path, overrides: dict[str, Any] | None = None
) -> Path:
    """``source``'s config (with ``overrides`` set on it) with seeded random weights, and its
    tokenizer, chat template and generation config, in ``dest``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, dest = Path(source), Path(dest)
    config = AutoConfig.from_pretrained(source)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest)
    for item in source.iterdir():  # tokenizer, chat template, generation config
        # Not radixlang's record of what a converted folder came from: these weights did not.
        if item.name == "radixlang-source.json":
            continue
        if item.is_file() and not (dest / item.name).exists():
            shutil.copy(item, dest / item.name)
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--max-position-embeddings", type=int, help="a context other than source's")
    args = p.parse_args(argv)
    overrides = {}
    if args.max_position_embeddings:
        overrides["max_position_embeddings"] = args.max_position_embeddings
    write_random_model(args.source, args.dest, overrides)
    print(f"wrote {args.dest}")


if __name__ == "__main__":
    main()
