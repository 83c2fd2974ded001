"""The tensors one forward pass reads: a packed batch of extend and decode sequences.

Sequences that compute several tokens (prefill, or extend after a cached prefix) come first,
their tokens packed back to back; sequences that compute one token after a cached prefix
(decode) come after them. Attention runs the first group with ``extend_attention`` and the
second with ``decode_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens] long
    positions: torch.Tensor  # [tokens] long: each token's position in its sequence
    slot_mapping: torch.Tensor  # [tokens] long: where each token's K/V is stored
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with 0
    prefix_lens: torch.Tensor  # [seqs] int32: tokens already cached before this pass
    extend_lens: torch.Tensor  # [seqs] int32: tokens computed in this pass
    seq_lens: torch.Tensor  # [seqs] int32: prefix_lens + extend_lens
    num_extend_seqs: int  # the first this many sequences take the extend path
    num_extend_tokens: int  # ... and own the first this many tokens
    # prefix_lens and extend_lens as Python ints: kernels read these instead of the tensors,
    # which on a GPU would cost a device sync per layer.
    host_prefix_lens: list[int]
    host_extend_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
