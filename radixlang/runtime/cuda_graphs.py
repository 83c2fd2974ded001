"""CUDA graphs for decode-only forward passes.

A decode step of a small batch is bound by launch overhead: hundreds of small kernels each
costing more to launch than to run. Here the decode forward is captured once per batch size
into a CUDA graph and replayed with one launch. A real batch of ``n`` one-token sequences is
copied into static input buffers, padded up to the next captured size with rows that do no
harm, and the graph of that size is replayed; the padding rows' outputs are dropped.

What makes the decode forward capturable (``LlamaForCausalLM.forward`` on the Triton kernels):
every tensor it reads is on the device, and every host value it reads is fixed by the padded
batch size alone or by the static buffers' shapes:

- the token and sequence counts: the padded size;
- the block tables' width, which sizes the decode-attention grid (its KV partitions) and its
  reduce step: the static table is as wide as any sequence's table can be, so the captured
  grid covers every length (the kernels read each row only up to its ``seq_len``). The cost:
  a replay launches every partition of a full-length table, the empty ones returning at once;
- ``num_extend_seqs`` is 0, so the extend path and ``host_prefix_lens``/``host_extend_lens``
  are never read (the decode branch takes their first 0 entries);
- on the Triton path ``plan_decode`` builds nothing and nothing is read back to the host. The
  torch path's plan reads ``max(seq_lens)`` back (a sync, which a capture forbids), which is
  why graphs need the Triton kernels.

Padding rows: token 0 at position 0, ``seq_len`` 1, a block table of zeros (reading block 0's
first slot is harmless) and slot -1, which the Triton ``store_kv`` drops, so the cache is only
written at the real rows' slots.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.kv_cache import KVCache
from radixlang.runtime.models.llama import LlamaForCausalLM

DEFAULT_MAX_BATCH = 256
# Small batches are common (a few requests decoding) and a step's cost grows with the padded
# size, so they get power-of-two sizes; beyond 8, one graph per 8 keeps padding under 8 rows
# without capturing a graph per size.
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8
# Eager runs before a capture: the first compiles the Triton kernels and picks cuBLAS
# algorithms, the second runs with everything cached, as a replay will.
WARMUP_RUNS = 2
PADDING_SLOT = -1  # outside the cache: the Triton store_kv skips it


def capture_sizes(max_batch: int = DEFAULT_MAX_BATCH) -> list[int]:
    """The batch sizes to capture, ascending: 1, 2, 4, 8, then every 8 up to ``max_batch``,
    which is itself included so that every batch up to it fits."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    sizes = [s for s in SMALL_SIZES if s <= max_batch]
    sizes += range(SMALL_SIZES[-1] + SIZE_STEP, max_batch + 1, SIZE_STEP)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``n`` rows; None if none does."""
    if n < 1:
        raise ValueError(f"a batch has at least one row; got {n}")
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def decode_table_width(
    max_context: int, block_size: int, num_blocks: int, sliding_window: int | None
) -> int:
    """Block-table entries a decode sequence may need: those of the model's whole context,
    and no more than the pool holds unless a sliding window lets a sequence release blocks
    (its table then keeps placeholders for them and may outgrow the pool)."""
    width = -(-max_context // block_size)
    return width if sliding_window is not None else min(width, num_blocks)


class DecodeGraphInputs:
    """The device buffers a captured decode graph reads, sized for its largest batch.

    They are allocated once and only ever written in place: a graph reads these exact
    storages. Every row past the real ones is a padding row (see the module docstring).
    """

    def __init__(self, max_batch: int, max_blocks: int, device: str | torch.device) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"need max_batch, max_blocks >= 1; got {max_batch}, {max_blocks}")
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        device = torch.device(device)
        long, i32 = torch.long, torch.int32
        # Normal tensors even if made under inference mode: fill writes them in place, which
        # inference tensors refuse outside inference mode.
        with torch.inference_mode(False):
            self.input_ids = torch.zeros(max_batch, dtype=long, device=device)
            self.positions = torch.zeros(max_batch, dtype=long, device=device)
            self.slot_mapping = torch.full((max_batch,), PADDING_SLOT, dtype=long, device=device)
            self.block_tables = torch.zeros((max_batch, max_blocks), dtype=i32, device=device)
            self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
            self.prefix_lens = torch.zeros(max_batch, dtype=i32, device=device)
            # Every row, real or padding, computes one token: never rewritten.
            self.extend_lens = torch.ones(max_batch, dtype=i32, device=device)
            # A decode row's logits are its only token's: row i is row i, for every batch.
            self.logit_rows = torch.arange(max_batch, dtype=long, device=device)

    def fill(self, batch: ForwardBatch) -> None:
        """Copy a decode-only ``batch`` into the first ``batch.num_seqs`` rows and make every
        later row a padding row. Device-to-device copies only: no host sync."""
        n = batch.num_seqs
        if batch.num_extend_seqs or batch.num_tokens != n:
            raise ValueError("only a batch of one-token decodes fills the graph inputs")
        if n > self.max_batch:
            raise ValueError(f"a batch of {n} exceeds the largest captured size {self.max_batch}")
        width = batch.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block tables {width} wide exceed the static {self.max_blocks}")
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(batch.positions)
        self.positions[n:].zero_()
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:].fill_(PADDING_SLOT)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.seq_lens[n:].fill_(1)
        self.prefix_lens[:n].copy_(batch.prefix_lens)
        self.prefix_lens[n:].zero_()
        self.block_tables[:n, :width].copy_(batch.block_tables)
        # The kernels read a row only up to its seq_len, but entries left from an earlier,
        # wider batch are cleared anyway: nothing stale stays where a bad length could reach.
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:].zero_()

    def batch(self, size: int) -> ForwardBatch:
        """The first ``size`` rows as a decode-only batch: views of the static buffers."""
        if not 1 <= size <= self.max_batch:
            raise ValueError(f"size must lie in [1, {self.max_batch}]; got {size}")
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            prefix_lens=self.prefix_lens[:size],
            extend_lens=self.extend_lens[:size],
            seq_lens=self.seq_lens[:size],
            num_extend_seqs=0,
            num_extend_tokens=0,
            # Read only for extend sequences (none here), so a capture may bake in any
            # values: these match the padding rows.
            host_prefix_lens=[0] * size,
            host_extend_lens=[1] * size,
        )


class Replayable(Protocol):
    """What the runner needs of a captured graph (``torch.cuda.CUDAGraph``; tests stand in
    for it on CPUs)."""

    def replay(self) -> None: ...


class DecodeGraphRunner:
    """One captured CUDA graph per batch size of the decode-only forward pass.

    Make it with :meth:`capture`; :meth:`run` replays the graph of the smallest captured size
    that holds a batch.
    """

    def __init__(
        self,
        inputs: DecodeGraphInputs,
        graphs: Mapping[int, Replayable],
        logits: torch.Tensor,
    ) -> None:
        self.inputs = inputs
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.logits = logits

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def max_blocks(self) -> int:
        return self.inputs.max_blocks

    @classmethod
    def capture(
        cls,
        model: LlamaForCausalLM,
        kv: KVCache,
        sizes: Sequence[int],
        max_blocks: int | None = None,
    ) -> DecodeGraphRunner:
        """Capture the model's decode forward over ``kv`` for each of ``sizes``.

        ``max_blocks`` is the static block tables' width (by default every entry a sequence
        of the model's context may need). The model must run on the Triton kernels (the
        caller's check: see the module docstring). The warm-up runs are all padding rows, so
        capturing leaves the cache as it was.
        """
        device = kv.k.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV cache is on {device}")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be >= 1 and at least one; got {list(sizes)}")
        arch = model.arch
        if max_blocks is None:
            max_blocks = decode_table_width(
                arch.max_context, kv.block_size, kv.num_blocks, arch.sliding_window
            )
        ordered = sorted(set(sizes), reverse=True)
        graphs: dict[int, Replayable] = {}
        with torch.cuda.device(device):
            inputs = DecodeGraphInputs(ordered[0], max_blocks, device)
            with torch.inference_mode(False):
                # One output for every size, rather than each graph keeping its own: the
                # per-size outputs would together hold sum(sizes) rows of the vocabulary (16x
                # this one at the default sizes), for a device-side copy per replay.
                logits = torch.empty(
                    (ordered[0], arch.vocab_size), dtype=torch.float32, device=device
                )
            # Shared by all the graphs (they never replay at once); largest first, so that the
            # smaller ones fit in the memory the largest already took.
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            for size in ordered:
                batch, rows = inputs.batch(size), inputs.logit_rows[:size]
                # Warm up off the default stream, as capture itself runs on a side stream.
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        model.forward(batch, kv, rows)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the engine's helper threads may touch CUDA meanwhile; only
                # this thread's capture-unsafe calls are errors.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits[:size].copy_(model.forward(batch, kv, rows))
                graphs[size] = graph
            torch.cuda.synchronize(device)
        return cls(inputs, graphs, logits)

    def fits(self, num_seqs: int, width: int) -> bool:
        """Whether a decode batch of ``num_seqs`` rows with block tables ``width`` wide can
        replay a graph."""
        return num_seqs <= self.max_batch and width <= self.inputs.max_blocks

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the decode-only ``batch``; its ``[n, vocab]`` float32 next-token logits.

        The logits are a view of the graphs' output buffer, not a copy: the next ``run``
        overwrites them, so the caller samples from them (or clones them) first. The engine
        does, and a clone per step would copy ``n x vocab`` floats for nothing.
        """
        n = batch.num_seqs
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"a batch of {n} exceeds the largest captured size {self.max_batch}")
        # On the current device and stream, as the eager path's kernels run.
        self.inputs.fill(batch)
        self.graphs[size].replay()
        return self.logits[:n]
