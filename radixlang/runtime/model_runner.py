"""Model runner: a list of sequences to compute → one packed forward pass → logits.

Each sequence names the tokens to compute now, how many of its tokens are already in the KV
cache (``prefix_len``), and the block table that covers both. The runner packs them (extend
sequences first, then one-token decodes), builds positions and slot mappings, runs the model,
and returns every sequence's next-token logits in the order given, plus, on request, the
log-probabilities of its computed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlang import kernels
from radixlang.models import DEFAULT_MODEL, ModelFiles, load_model_files
from radixlang.runtime.block_pool import blocks_for
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.kv_cache import KVCache, default_kv_budget
from radixlang.runtime.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BatchError(ValueError):
    """A sequence in the batch is malformed (lengths, block table, token ids)."""


@dataclass
class SequenceInput:
    """One sequence's part of a forward pass."""

    tokens: Sequence[int]  # the tokens to compute now (at least one)
    prefix_len: int  # tokens of this sequence already in the KV cache, before ``tokens``
    block_table: Sequence[int]  # blocks covering positions 0 .. prefix_len + len(tokens) - 1
    return_logprobs: bool = False  # log-probabilities of tokens[1:] (see ForwardOutput)
    top_logprobs: int = 0  # with return_logprobs: the k most likely tokens after every token


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [seqs, vocab] float32: next-token logits after each sequence
    # Per sequence (None unless requested): [len(tokens) - 1] float32, entry i the
    # log-probability of tokens[i + 1] given everything before it. To score tokens[0] too,
    # compute one more token (shorten the cached prefix by one).
    prompt_logprobs: list[torch.Tensor | None]
    # Per sequence (None unless top_logprobs > 0): (logprobs, token ids), each
    # [len(tokens), k], row i the k most likely tokens to follow tokens[i], best first.
    prompt_top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


class ModelRunner:
    """Owns the native model and its KV storage; runs packed batches."""

    def __init__(
        self,
        model: str | Path | ModelFiles = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_budget_bytes: int | None = None,
        kv_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.files = model if isinstance(model, ModelFiles) else load_model_files(model)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.model = LlamaForCausalLM.from_folder(
            self.files.path, dtype=self.dtype, device=self.device, config=self.files.hf_config()
        )
        cache_dtype = resolve_dtype(kv_dtype) if kv_dtype is not None else self.dtype
        if cache_dtype != self.dtype and kernels.use_triton(self.model.embed):
            raise ValueError(
                f"a {cache_dtype} KV cache under {self.dtype} weights runs on the torch kernels "
                f"only; the Triton kernels need the two to match"
            )
        shape = self.model.arch.kv_shape
        if num_blocks is not None:
            self.kv = KVCache(shape, num_blocks, block_size, cache_dtype, self.device)
        else:
            budget = (
                kv_budget_bytes if kv_budget_bytes is not None else default_kv_budget(self.device)
            )
            self.kv = KVCache.from_budget(shape, budget, block_size, cache_dtype, self.device)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def max_context(self) -> int:
        return self.model.arch.max_context

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    def copy_block(self, src: int, dst: int, num_slots: int) -> None:
        """The ``BlockPool`` copy-on-write hook for this runner's KV storage."""
        self.kv.copy_block(src, dst, num_slots)

    def describe(self) -> dict[str, object]:
        arch = self.model.arch
        return {
            "model": self.files.name,
            "model_type": arch.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "weights_bytes": self.model.num_parameter_bytes,
            "max_context": arch.max_context,
            "kv_cache": self.kv.describe(),
        }

    def forward(self, seqs: Sequence[SequenceInput]) -> ForwardOutput:
        """Compute the sequences' tokens in one packed pass and store their K/V."""
        if not seqs:
            raise BatchError("a forward pass needs at least one sequence")
        for seq in seqs:
            self._check(seq)
        # Extends first, then decodes: attention runs each group with its own kernel.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens) == 1)
        ordered = [seqs[i] for i in order]
        batch = self._build_batch(ordered)
        rows, spans = _logit_rows(ordered)
        logits = self.model.forward(batch, self.kv, torch.tensor(rows, device=self.device))

        # Each sequence's last row, in the order given: one gather, none when rows line up.
        last_rows = [0] * len(seqs)
        for position, index in enumerate(order):
            last_rows[index] = spans[position][1] - 1
        if last_rows == list(range(logits.shape[0])):
            last = logits
        else:
            last = logits.index_select(0, torch.tensor(last_rows, device=logits.device))
        logprobs: list[torch.Tensor | None] = [None] * len(seqs)
        top: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)
        for position, (index, (start, end)) in enumerate(zip(order, spans, strict=True)):
            seq = ordered[position]
            if seq.return_logprobs:
                scores = torch.log_softmax(logits[start:end], dim=-1)
                following = torch.tensor(list(seq.tokens[1:]), device=self.device)
                logprobs[index] = scores[:-1].gather(1, following[:, None]).squeeze(1)
                if seq.top_logprobs > 0:
                    values, ids = scores.topk(min(seq.top_logprobs, scores.shape[1]), dim=-1)
                    top[index] = (values, ids)
        return ForwardOutput(last, logprobs, top)

    def _check(self, seq: SequenceInput) -> None:
        n = len(seq.tokens)
        total = seq.prefix_len + n
        if n == 0:
            raise BatchError("a sequence must compute at least one token")
        if seq.top_logprobs < 0 or (seq.top_logprobs and not seq.return_logprobs):
            raise BatchError("top_logprobs must be >= 0 and needs return_logprobs")
        if seq.prefix_len < 0:
            raise BatchError(f"prefix_len must be >= 0, got {seq.prefix_len}")
        if total > self.max_context:
            raise BatchError(
                f"sequence of {total} tokens exceeds the model's context of {self.max_context}"
            )
        needed = blocks_for(total, self.block_size)
        if len(seq.block_table) < needed:
            raise BatchError(
                f"{total} tokens need {needed} blocks of {self.block_size}; "
                f"the block table has {len(seq.block_table)}"
            )
        if any(not 0 <= b < self.num_blocks for b in seq.block_table[:needed]):
            raise BatchError(f"block ids must lie in [0, {self.num_blocks})")
        if any(not 0 <= t < self.vocab_size for t in seq.tokens):
            raise BatchError(f"token ids must lie in [0, {self.vocab_size})")

    def _build_batch(self, seqs: Sequence[SequenceInput]) -> ForwardBatch:
        block_size = self.block_size
        extend_lens = [len(s.tokens) for s in seqs]
        prefix_lens = [s.prefix_len for s in seqs]
        counts = [
            blocks_for(p + n, block_size) for p, n in zip(prefix_lens, extend_lens, strict=True)
        ]
        tables = torch.zeros(len(seqs), max(counts), dtype=torch.int32)
        for row, (seq, count) in enumerate(zip(seqs, counts, strict=True)):
            tables[row, :count] = torch.tensor(list(seq.block_table[:count]), dtype=torch.int32)
        ext = torch.tensor(extend_lens)
        prefix = torch.tensor(prefix_lens)
        owner = torch.repeat_interleave(torch.arange(len(seqs)), ext)
        starts = torch.cumsum(ext, 0) - ext
        positions = prefix[owner] + torch.arange(len(owner)) - starts[owner]
        slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
        num_extend_seqs = sum(1 for n in extend_lens if n > 1)
        device = self.device
        return ForwardBatch(
            input_ids=torch.tensor([t for s in seqs for t in s.tokens], device=device),
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            prefix_lens=prefix.to(torch.int32).to(device),
            extend_lens=ext.to(torch.int32).to(device),
            seq_lens=(prefix + ext).to(torch.int32).to(device),
            num_extend_seqs=num_extend_seqs,
            num_extend_tokens=sum(extend_lens[:num_extend_seqs]),
            host_prefix_lens=prefix_lens,
            host_extend_lens=extend_lens,
        )


def _logit_rows(seqs: Sequence[SequenceInput]) -> tuple[list[int], list[tuple[int, int]]]:
    """Rows of the packed batch whose logits are needed, and each sequence's span in them."""
    rows: list[int] = []
    spans = []
    token_start = 0
    for seq in seqs:
        n = len(seq.tokens)
        chosen = (
            range(token_start, token_start + n) if seq.return_logprobs else [token_start + n - 1]
        )
        spans.append((len(rows), len(rows) + len(chosen)))
        rows.extend(chosen)
        token_start += n
    return rows, spans
