"""Model runner: a list of sequences to compute → one packed forward pass → logits.

Each sequence names the tokens to compute now, how many of its tokens are already in the KV
cache (``prefix_len``), and the block table that covers both. The runner packs them (extend
sequences first, then one-token decodes), builds positions and slot mappings, runs the model,
and returns every sequence's next-token logits in the order given, plus, on request, the
log-probabilities of its computed tokens.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlang import kernels
from radixlang.model_files import DEFAULT_MODEL, ModelFiles, is_gguf_file, load_model_files
from radixlang.runtime.block_pool import RELEASED, blocks_for, dead_blocks
from radixlang.runtime.cuda_graphs import DEFAULT_MAX_BATCH, DecodeGraphRunner, capture_sizes
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.kv_cache import KVCache, default_kv_budget
from radixlang.runtime.models import gguf_weights  # noqa: F401 (registers its GGUF weight writer)
from radixlang.runtime.models.linear import QUANTIZATIONS
from radixlang.runtime.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BatchError(ValueError):
    """A sequence in the batch is malformed (lengths, block table, token ids)."""


@dataclass
class SequenceInput:
    """One sequence's part of a forward pass."""

    tokens: Sequence[int]  # the tokens to compute now (at least one)
    prefix_len: int  # tokens of this sequence already in the KV cache, before ``tokens``
    # Blocks covering positions 0 .. prefix_len + len(tokens) - 1. Under a sliding window the
    # blocks wholly before the first new token's window may be RELEASED (see ``dead_blocks``).
    block_table: Sequence[int]
    return_logprobs: bool = False  # log-probabilities of tokens[1:] (see ForwardOutput)
    top_logprobs: int = 0  # with return_logprobs: the k most likely tokens after every token
    all_logits: bool = False  # the logits after every token (verifying a draft), not only the last


@dataclass
class ForwardOutput:
    # [seqs, vocab] float32: next-token logits after each sequence. From a CUDA graph replay
    # (see ``ModelRunner``) a view of the graphs' output buffer, which the next forward
    # overwrites: read (or clone) it before then.
    logits: torch.Tensor
    # Per sequence (None unless requested): [len(tokens) - 1] float32, entry i the
    # log-probability of tokens[i + 1] given everything before it. To score tokens[0] too,
    # compute one more token (shorten the cached prefix by one).
    prompt_logprobs: list[torch.Tensor | None]
    # Per sequence (None unless top_logprobs > 0): (logprobs, token ids), each
    # [len(tokens), k], row i the k most likely tokens to follow tokens[i], best first.
    prompt_top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None]
    # Per sequence (None unless all_logits): [len(tokens), vocab], row i the logits after
    # tokens[i]. Views of one tensor, like ``logits``.
    token_logits: list[torch.Tensor | None] | None = None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _resolve_quantization(quantization: str, model: str | Path | ModelFiles) -> str:
    """``auto``: a ``.gguf`` file's own blocks (``gguf``), anything else as ``none``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}"
        )
    if quantization != "auto":
        return quantization
    if isinstance(model, ModelFiles):
        return "gguf" if model.gguf is not None else "none"
    return "gguf" if is_gguf_file(model) else "none"


class ModelRunner:
    """Owns the native model and its KV storage; runs packed batches.

    On a CUDA device (with the Triton kernels) a batch of one-token decodes without logprobs
    replays a captured CUDA graph (``cuda_graphs.py``), padded up to the next captured batch
    size; every other batch runs eagerly. ``cuda_graphs`` None turns that on exactly there
    (never for a mixture-of-experts model: its expert dispatch syncs with the host);
    ``cuda_graph_max_batch`` is the largest batch captured. The graphs are captured at the
    first such batch, or up front by :meth:`capture_cuda_graphs`.

    ``deterministic``: every sequence's logits are bitwise the same whatever else is in the
    batch and however its tokens were split into passes (see ``LlamaForCausalLM``).
    """

    def __init__(
        self,
        model: str | Path | ModelFiles = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_budget_bytes: int | None = None,
        kv_dtype: str | torch.dtype | None = None,
        quantization: str = "auto",
        cuda_graphs: bool | None = None,
        cuda_graph_max_batch: int = DEFAULT_MAX_BATCH,
        deterministic: bool = False,
    ) -> None:
        quantization = _resolve_quantization(quantization, model)
        if isinstance(model, ModelFiles):
            self.files = model
        else:
            self.files = load_model_files(model, keep_gguf=quantization == "gguf")
        self.deterministic = deterministic
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        if cuda_graphs and self.device.type != "cuda":  # said before the weights load
            raise ValueError(
                f"cuda_graphs=True needs a CUDA device; this runner is on {self.device}"
            )
        if cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1; got {cuda_graph_max_batch}")
        if quantization == "gguf" and self.files.gguf is None:
            raise ValueError(
                f"quantization='gguf' serves a GGUF file's blocks; {self.files.name} was not "
                f"loaded from one (pass the .gguf file, or choose none or int8)"
            )
        if quantization == "gguf":
            self.model = LlamaForCausalLM.from_gguf(
                self.files.gguf,  # type: ignore[arg-type]
                config=self.files.hf_config(),
                dtype=self.dtype,
                device=self.device,
                deterministic=deterministic,
            )
        else:
            self.model = LlamaForCausalLM.from_folder(
                self.files.path,
                dtype=self.dtype,
                device=self.device,
                config=self.files.hf_config(),
                quantization=quantization,
                deterministic=deterministic,
            )
        self.quantization = quantization
        cache_dtype = resolve_dtype(kv_dtype) if kv_dtype is not None else self.dtype
        if cache_dtype != self.dtype and kernels.use_triton(self.model.norm):
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
        # Graphs need the Triton kernels: the torch path's decode plan reads the batch's longest
        # sequence back to the host, which a capture forbids.
        triton = self.device.type == "cuda" and kernels.use_triton(self.model.norm)
        if cuda_graphs and not triton:
            raise ValueError(
                f"cuda_graphs=True needs the Triton kernels; RADIXLANG_KERNELS is "
                f"{kernels.kernel_mode()!r}"
            )
        # A sparse MLP reads its experts' row counts back to the host, which a capture forbids.
        sparse = bool(self.model.arch.moe_layers)
        if cuda_graphs and sparse:
            raise ValueError("cuda_graphs=True is not supported for a mixture-of-experts model")
        self.cuda_graphs = (triton and not sparse) if cuda_graphs is None else cuda_graphs
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self._graphs: DecodeGraphRunner | None = None

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
    def sliding_window(self) -> int | None:
        """The window every layer attends within (None if any layer sees all): blocks before
        it may be released, and a sequence's context may outgrow the pool."""
        return self.model.arch.sliding_window

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
            "quantization": self.quantization,
            "deterministic": self.deterministic,
            "device": str(self.device),
            "weights_bytes": self.model.num_parameter_bytes,
            "max_context": arch.max_context,
            "sliding_window": arch.sliding_window,
            "kv_cache": self.kv.describe(),
            "cuda_graphs": self.cuda_graphs,
            # Empty until captured (at the first decode-only batch).
            "cuda_graph_sizes": [] if self._graphs is None else list(self._graphs.sizes),
        }

    def capture_cuda_graphs(self) -> DecodeGraphRunner:
        """Capture the decode graphs now, if not yet done (otherwise the first decode-only
        forward captures them): seconds for a large model, better spent at start-up."""
        if not self.cuda_graphs:
            raise ValueError("CUDA graphs are off for this runner")
        if self._graphs is None:
            sizes = capture_sizes(self.cuda_graph_max_batch)
            self._graphs = DecodeGraphRunner.capture(self.model, self.kv, sizes)
        return self._graphs

    def forward(self, seqs: Sequence[SequenceInput]) -> ForwardOutput:
        """Compute the sequences' tokens in one packed pass and store their K/V."""
        if not seqs:
            raise BatchError("a forward pass needs at least one sequence")
        if any(seq.all_logits for seq in seqs) and (self.cuda_graphs or self.deterministic):
            # Drafts to verify: as decodes where decode graphs are replayed, and where a
            # verified token's logits must be bitwise a decode's. Elsewhere an extend: the
            # kernels' multi-query tiles read each sequence's KV once for all its drafts.
            return self._forward_as_decodes(seqs)
        if self.cuda_graphs and all(len(q.tokens) == 1 and not q.return_logprobs for q in seqs):
            return self.run_decode(self.prepare_decode(seqs))  # a replay where one fits
        # Extends first, then decodes: attention runs each group with its own kernel.
        decodes = [len(seq.tokens) == 1 for seq in seqs]
        if all(decodes) or not any(decodes):
            order: Sequence[int] = range(len(seqs))
            ordered = seqs
        else:
            order = sorted(range(len(seqs)), key=decodes.__getitem__)
            ordered = [seqs[i] for i in order]
        rows, spans = _logit_rows(ordered)
        built = self._build_batch(ordered, rows)
        if built is None:  # a malformed sequence: raise its error, checking in the given order
            for seq in seqs:
                self._check(seq)
            raise AssertionError("the batch failed its checks, but no sequence did")
        batch, logit_rows = built
        logits = self.model.forward(batch, self.kv, logit_rows)

        logprobs: list[torch.Tensor | None] = [None] * len(seqs)
        top: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)
        scored = any(seq.return_logprobs or seq.all_logits for seq in seqs)
        if isinstance(order, range) and not scored:
            return ForwardOutput(logits, logprobs, top)  # a row per sequence, in order
        # Each sequence's last row, in the order given: one gather, none when rows line up.
        last_rows = [0] * len(seqs)
        for position, index in enumerate(order):
            last_rows[index] = spans[position][1] - 1
        if last_rows == list(range(logits.shape[0])):
            last = logits
        else:
            last = logits.index_select(0, torch.tensor(last_rows, device=logits.device))
        token_logits: list[torch.Tensor | None] = [None] * len(seqs)
        for position, (index, (start, end)) in enumerate(zip(order, spans, strict=True)):
            seq = ordered[position]
            if seq.all_logits:
                token_logits[index] = logits[start:end]
            if seq.return_logprobs:
                scores = torch.log_softmax(logits[start:end], dim=-1)
                following = torch.tensor(list(seq.tokens[1:]), device=self.device)
                logprobs[index] = scores[:-1].gather(1, following[:, None]).squeeze(1)
                if seq.top_logprobs > 0:
                    values, ids = scores.topk(min(seq.top_logprobs, scores.shape[1]), dim=-1)
                    top[index] = (values, ids)
        return ForwardOutput(last, logprobs, top, token_logits)

    def _forward_as_decodes(self, seqs: Sequence[SequenceInput]) -> ForwardOutput:
        """:meth:`forward` for a batch with ``all_logits`` sequences (drafts to verify): each
        of their tokens is computed as a decode of its own, one query over the positions up to
        it (a layer stores every token's K/V before any attends, so a token sees the ones
        before it in the same pass). The decode kernel then serves the whole step, and a
        token's logits are computed as a decode step would compute them."""
        flat: list[SequenceInput] = []
        spans: list[tuple[int, int]] = []
        for seq in seqs:
            if not seq.all_logits:
                spans.append((len(flat), len(flat) + 1))
                flat.append(seq)
                continue
            if seq.return_logprobs:
                raise BatchError("all_logits does not go with return_logprobs")
            start = len(flat)
            for j, token in enumerate(seq.tokens):
                flat.append(SequenceInput([token], seq.prefix_len + j, seq.block_table))
            spans.append((start, len(flat)))
        out = self.forward(flat)
        last = [end - 1 for _, end in spans]
        logits = out.logits.index_select(0, torch.tensor(last, device=out.logits.device))
        token_logits: list[torch.Tensor | None] = [None] * len(seqs)
        logprobs: list[torch.Tensor | None] = [None] * len(seqs)
        top: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)
        for i, (seq, (start, end)) in enumerate(zip(seqs, spans, strict=True)):
            if seq.all_logits:
                token_logits[i] = out.logits[start:end]
            else:
                logprobs[i], top[i] = out.prompt_logprobs[start], out.prompt_top_logprobs[start]
        return ForwardOutput(logits, logprobs, top, token_logits)

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
        table = seq.block_table[:needed]
        window = self.sliding_window
        dead = 0 if window is None else dead_blocks(seq.prefix_len, window, self.block_size)
        n = self.num_blocks
        if any(b != RELEASED and not 0 <= b < n for b in table[:dead]) or any(
            not 0 <= b < n for b in table[dead:]
        ):
            where = " (released ones only before the window)" if window is not None else ""
            raise BatchError(f"block ids must lie in [0, {n}){where}")
        if any(not 0 <= t < self.vocab_size for t in seq.tokens):
            raise BatchError(f"token ids must lie in [0, {self.vocab_size})")

    def _build_batch(
        self, seqs: Sequence[SequenceInput], logit_rows: list[int]
    ) -> tuple[ForwardBatch, torch.Tensor] | None:
        """The packed batch and ``logit_rows`` as a tensor on the device; None when a sequence
        fails the checks of :meth:`_check` (which then says which and why)."""
        host = self._pack_batch(seqs, logit_rows)
        return None if host is None else host.to_device(self.device)

    def _pack_batch(self, seqs: Sequence[SequenceInput], logit_rows: list[int]) -> HostBatch | None:
        """The host half of :meth:`_build_batch`: the batch packed on the host, checked.

        Built as Python lists (per block, not per token, for the slots) and turned into two
        host tensors, one int64 and one int32, each moved to the device in one copy; the
        batch's tensors are views of them, every one starting 64-byte aligned.
        """
        lists = self._decode_lists(seqs)  # the common step: one token per sequence
        if lists is None:
            lists = self._extend_lists(seqs)
        prefix_lens, extend_lens, seq_lens, counts, input_ids, positions, slots = lists
        if not counts:
            return None  # a sequence failed its checks
        width = max(counts)
        tables: list[int] = []
        for seq, count in zip(seqs, counts, strict=True):
            tables += seq.block_table[:count]
            if count < width:
                tables += [0] * (width - count)
        # Ids in range, checked over the whole batch at once. (The slots were read through
        # the tables, so a bad block id may have made a bad slot: it is refused here.)
        if min(tables) < 0 and not self._fill_released(seqs, width, tables):
            return None
        if max(tables) >= self.num_blocks:
            return None
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            return None
        num_extend_seqs = sum(1 for n in extend_lens if n > 1)
        longs, long_at = _pack([input_ids, positions, slots, logit_rows], _host_longs)
        ints, int_at = _pack([prefix_lens, extend_lens, seq_lens, tables], _host_ints)
        return HostBatch(
            longs,
            long_at,
            ints,
            int_at,
            len(seqs),
            len(input_ids),
            width,
            len(logit_rows),
            num_extend_seqs,
            sum(extend_lens[:num_extend_seqs]),
            prefix_lens,
            extend_lens,
        )

    # ---- a decode step in two halves (overlapped scheduling: runtime/overlap.py) --------------
    def prepare_decode(self, seqs: Sequence[SequenceInput]) -> HostBatch:
        """The host half of :meth:`forward` for one-token decodes without logprobs: checks and
        packing, on the calling thread. :meth:`set_input_ids` may change the tokens after it
        (the placeholders of overlapped scheduling); :meth:`run_decode` is the device half."""
        if not seqs or any(len(seq.tokens) != 1 or seq.return_logprobs for seq in seqs):
            raise BatchError("prepare_decode takes one-token decodes without logprobs")
        host = self._pack_batch(seqs, list(range(len(seqs))))
        if host is None:  # a malformed sequence: its error, in the given order
            for seq in seqs:
                self._check(seq)
            raise AssertionError("the batch failed its checks, but no sequence did")
        return host

    def set_input_ids(self, prepared: HostBatch, rows: list[int], ids: list[int]) -> None:
        """Put token ``ids[i]`` in as the input of decode ``rows[i]`` (before the run)."""
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise BatchError(f"token ids must lie in [0, {vocab})")
        values = prepared.longs.numpy()
        base = prepared.long_at[0]
        for row, token in zip(rows, ids, strict=True):
            values[base + row] = token

    def run_decode(self, host: HostBatch) -> ForwardOutput:
        """The device half: the prepared decodes' logits, a row per sequence, in order; a
        CUDA graph replay where one fits (graphs on, at most the largest captured size, a
        table no wider than the graphs', the kernels still Triton), else eagerly."""
        n = host.num_seqs
        replay = self.cuda_graphs and n <= self.cuda_graph_max_batch
        if replay and kernels.use_triton(self.model.norm):
            graphs = self._graphs or self.capture_cuda_graphs()
            if graphs.fits(n, host.width):
                batch, _ = host.to_device(self.device)
                return ForwardOutput(graphs.run(batch), [None] * n, [None] * n)
        batch, logit_rows = host.to_device(self.device)
        return ForwardOutput(self.model.forward(batch, self.kv, logit_rows), [None] * n, [None] * n)

    def _fill_released(self, seqs: Sequence[SequenceInput], width: int, tables: list[int]) -> bool:
        """Point released entries of the packed ``tables`` at block 0, which the kernels never
        read there (they start at each query's window); False if an entry is negative anywhere
        else (or the model has no window)."""
        window = self.sliding_window
        if window is None:
            return False
        for row, seq in enumerate(seqs):
            base = row * width
            dead = dead_blocks(seq.prefix_len, window, self.block_size)
            for i in range(base, base + width):
                if tables[i] < 0:
                    if tables[i] != RELEASED or i - base >= dead:
                        return False
                    tables[i] = 0
        return True

    def _decode_lists(self, seqs: Sequence[SequenceInput]) -> _Lists | None:
        """For a batch of one-token sequences without logprobs, the lists :meth:`_build_batch`
        builds (see ``_Lists``), made a column at a time; ``_FAILED`` if a sequence fails the
        checks. None for any other batch."""
        if any(len(seq.tokens) != 1 or seq.top_logprobs for seq in seqs):
            return None
        block_size = self.block_size
        prefix_lens = [seq.prefix_len for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        seq_lens = [prefix + 1 for prefix in prefix_lens]
        counts = [prefix // block_size + 1 for prefix in prefix_lens]
        if min(prefix_lens) < 0 or max(seq_lens) > self.max_context:
            return _FAILED
        if any(len(table) < count for table, count in zip(tables, counts, strict=True)):
            return _FAILED
        slots = [
            table[prefix // block_size] * block_size + prefix % block_size
            for table, prefix in zip(tables, prefix_lens, strict=True)
        ]
        input_ids = [seq.tokens[0] for seq in seqs]
        return prefix_lens, [1] * len(seqs), seq_lens, counts, input_ids, prefix_lens[:], slots

    def _extend_lists(self, seqs: Sequence[SequenceInput]) -> _Lists:
        """The lists :meth:`_build_batch` builds (see ``_Lists``), for any batch, a sequence at
        a time (slots a block at a time); ``_FAILED`` if a sequence fails the checks."""
        block_size, max_context = self.block_size, self.max_context
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        seq_lens: list[int] = []
        counts: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in seqs:
            tokens, prefix, table, k = seq.tokens, seq.prefix_len, seq.block_table, seq.top_logprobs
            n = len(tokens)
            total = prefix + n
            count = -(-total // block_size)
            if n == 0 or prefix < 0 or total > max_context or len(table) < count or k < 0:
                return _FAILED
            if k and not seq.return_logprobs:
                return _FAILED
            prefix_lens.append(prefix)
            extend_lens.append(n)
            seq_lens.append(total)
            counts.append(count)
            input_ids += tokens
            if n == 1:
                positions.append(prefix)
                slots.append(table[prefix // block_size] * block_size + prefix % block_size)
                continue
            positions += range(prefix, total)
            pos = prefix
            while pos < total:  # one run of slots per block the tokens touch
                index = pos // block_size
                stop = min(total, (index + 1) * block_size)
                base = (table[index] - index) * block_size
                slots += range(base + pos, base + stop)
                pos = stop
        return prefix_lens, extend_lens, seq_lens, counts, input_ids, positions, slots


@dataclass
class HostBatch:
    """A packed batch on the host: every int64 input in one tensor, every int32 one in another
    (each part starting where ``long_at``/``int_at`` say), ready for one copy each."""

    longs: torch.Tensor  # input ids, positions, slots, logit rows
    long_at: list[int]
    ints: torch.Tensor  # prefix, extend and sequence lengths, block tables
    int_at: list[int]
    num_seqs: int
    num_tokens: int
    width: int  # block-table columns
    num_logit_rows: int
    num_extend_seqs: int
    num_extend_tokens: int
    prefix_lens: list[int]
    extend_lens: list[int]

    def to_device(self, device: torch.device) -> tuple[ForwardBatch, torch.Tensor]:
        """The batch on ``device`` (views of two copies), and its logit rows."""
        longs, ints = self.longs.to(device), self.ints.to(device)
        long_at, int_at = self.long_at, self.int_at
        num_seqs, num_tokens = self.num_seqs, self.num_tokens
        batch = ForwardBatch(
            input_ids=longs[long_at[0] : long_at[0] + num_tokens],
            positions=longs[long_at[1] : long_at[1] + num_tokens],
            slot_mapping=longs[long_at[2] : long_at[2] + num_tokens],
            block_tables=ints[int_at[3] : int_at[3] + num_seqs * self.width].view(
                num_seqs, self.width
            ),
            prefix_lens=ints[int_at[0] : int_at[0] + num_seqs],
            extend_lens=ints[int_at[1] : int_at[1] + num_seqs],
            seq_lens=ints[int_at[2] : int_at[2] + num_seqs],
            num_extend_seqs=self.num_extend_seqs,
            num_extend_tokens=self.num_extend_tokens,
            host_prefix_lens=self.prefix_lens,
            host_extend_lens=self.extend_lens,
        )
        return batch, longs[long_at[3] : long_at[3] + self.num_logit_rows]


# Per sequence: prefix, extend and sequence lengths, block counts; per token: input ids,
# positions, slots.
_Lists = tuple[list[int], list[int], list[int], list[int], list[int], list[int], list[int]]
_FAILED: _Lists = ([], [], [], [], [], [], [])


_ALIGN = 16  # elements: 64 bytes of int32, 128 of int64


def _pack(
    parts: list[list[int]], to_tensor: Callable[[list[int]], torch.Tensor]
) -> tuple[torch.Tensor, list[int]]:
    """The parts back to back in one host tensor, each padded to a multiple of ``_ALIGN``
    elements; and where each starts."""
    flat: list[int] = []
    offsets = []
    for part in parts:
        offsets.append(len(flat))
        flat += part
        pad = -len(part) % _ALIGN
        if pad:
            flat += [0] * pad
    return to_tensor(flat), offsets


def _host_longs(values: list[int]) -> torch.Tensor:
    # Through an array: about 3x faster than torch.tensor on a list of Python ints.
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def _host_ints(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array.array("i", values), dtype=torch.int32)


def _logit_rows(seqs: Sequence[SequenceInput]) -> tuple[list[int], list[tuple[int, int]]]:
    """Rows of the packed batch whose logits are needed, and each sequence's span in them."""
    rows: list[int] = []
    spans = []
    token_start = 0
    for seq in seqs:
        n = len(seq.tokens)
        if seq.return_logprobs or seq.all_logits:
            spans.append((len(rows), len(rows) + n))
            rows += range(token_start, token_start + n)
        else:
            spans.append((len(rows), len(rows) + 1))
            rows.append(token_start + n - 1)
        token_start += n
    return rows, spans
