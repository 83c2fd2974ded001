"""Write a random-weight model with another model folder's architecture and tokenizer.

For timing where the real weights are not installed (a lent GPU machine): speed does not
depend on the weights' values, and the benchmarks ignore EOS.

    python benchmarks/make_random_model.py SOURCE_FOLDER DEST_FOLDER
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    source, dest = Path(argv[0]), Path(argv[1])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(dest)
    for item in source.iterdir():  # tokenizer, chat template, generation config
        if item.is_file() and not (dest / item.name).exists():
            shutil.copy(item, dest / item.name)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main(sys.argv[1:])
