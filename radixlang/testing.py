"""Test helpers: model folders with random weights and the default model's tokenizer, and a
null model forward for measuring the engine's host work.

A tiny random-weight llama that speaks the default model's tokenizer and chat template makes
frontend, server and benchmark smoke tests exercise real tokenization (byte-level BPE, chat
templates, 49,152 tokens) while the engine runs in milliseconds per step. Nothing is fetched:
the tokenizer files come from the installed default model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixlang.model_files import DEFAULT_MODEL, load_model_files

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")  # fmt: skip


def write_tiny_chat_model(
    folder: str | Path,
    *,
    layers: int = 2,
    hidden_size: int = 64,
    max_positions: int = 1024,
    weight_std: float = 0.5,
    seed: int = 0,
    extra_tokens: int = 0,
) -> Path:
    """Write a random llama (``layers`` x ``hidden_size``, 4 query and 2 KV heads) with the
    default model's vocabulary, tokenizer and chat template into ``folder``. Weights are drawn
    from N(0, ``weight_std``): wide enough that sampling wanders over the whole vocabulary.
    ``extra_tokens``: room for that many tokens added to the tokenizer after it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = Path(folder)
    default = load_model_files(DEFAULT_MODEL)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=default.config.vocab_size + extra_tokens,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, weight_std)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default.path / name).exists():
            shutil.copy(default.path / name, folder / name)
    return folder


# A Qwen3-style thinking template over ChatML: the model opens <think> itself; an earlier
# answer keeps its thinking (so the template stays append-only).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def write_tiny_thinking_model(folder: str | Path, **kwargs: Any) -> Path:
    """:func:`write_tiny_chat_model` with ``<think>`` and ``</think>`` added to the tokenizer as
    single tokens and a thinking chat template (``THINKING_TEMPLATE``): a reasoning model's
    shape, for tests of reasoning separation, constraints after thinking and budgets."""
    from transformers import AutoTokenizer

    folder = write_tiny_chat_model(folder, extra_tokens=2, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    return folder


class NullForward:
    """A model forward that computes nothing: fixed random logits of the right shape.

    Installed on an engine (:meth:`install`), it replaces only the model's layers: the
    engine still schedules, the model runner still checks the sequences, builds the packed
    batch (positions, slots, block tables) and picks the logit rows, and sampling, the
    detokenizer and the bookkeeping run as they do after a real forward. What an engine step
    costs with it is the host work around the model (``benchmarks/bench_host_overhead.py``).

    The logits (``[rows, vocab]`` float32, as the model returns them) are rows of a bank of
    ``bank_rows`` random rows, N(0, ``scale``) and drawn once: at temperature 0.7 and top_p
    0.9 such a row's nucleus is 1 to ~100 tokens (about 20 on average), so sampling does the
    work it does on a real model. Each call returns a contiguous slice of the bank (a view,
    no copy), starting one row further on than the last, so a request's tokens vary from step
    to step. The KV cache is never written.
    """

    def __init__(
        self,
        vocab_size: int,
        device: str | torch.device = "cpu",
        *,
        bank_rows: int = 1024,
        scale: float = 4.0,
        seed: int = 0,
    ) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        bank = torch.randn(bank_rows, vocab_size, generator=generator).mul_(scale)
        self.bank = bank.to(device)
        self.vocab_size = vocab_size
        self.calls = 0  # forward passes
        self.rows = 0  # logit rows returned, over all calls
        self._runner: Any = None  # the ModelRunner it is installed on

    def __call__(self, batch: Any, kv: Any, logit_rows: torch.Tensor) -> torch.Tensor:
        """``LlamaForCausalLM.forward(batch, kv, logit_rows)``: logits for ``logit_rows``.

        (This module imports no layer of the package, so the runtime's types go unnamed.)"""
        n = int(logit_rows.shape[0])
        bank_rows = self.bank.shape[0]
        self.calls += 1
        self.rows += n
        if n > bank_rows:  # more rows than the bank: repeat it (a copy)
            return self.bank.repeat(-(-n // bank_rows), 1)[:n]
        return self.bank.narrow(0, self.calls % (bank_rows - n + 1), n)

    @classmethod
    def install(cls, engine: Any, **kwargs: Any) -> NullForward:
        """Replace the model forward of ``engine`` (a ``radixlang.runtime.Engine``) with a new
        null forward (``kwargs`` go to the constructor); returns it. :meth:`uninstall` puts
        the model's own forward back."""
        runner = engine.runner
        null = cls(runner.vocab_size, runner.device, **kwargs)
        runner.model.forward = null
        null._runner = runner
        return null

    def uninstall(self) -> None:
        """Give the engine its model's own forward again."""
        if self._runner is not None:
            del self._runner.model.forward
            self._runner = None
