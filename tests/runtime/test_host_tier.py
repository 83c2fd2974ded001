"""The host tier's storage choice and its block copies (no model: a KV cache filled with
distinct values per block)."""

from __future__ import annotations

import random

import pytest
import torch

from radixlang.runtime import host_tier
from radixlang.runtime.host_tier import HostTier
from radixlang.runtime.kv_cache import KVCache, KVShape

SHAPE = KVShape(num_layers=3, kv_heads=2, head_dim=4)


def filled_kv(num_blocks: int = 24) -> KVCache:
    kv = KVCache(SHAPE, num_blocks, block_size=4, dtype=torch.float32)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    return kv


def test_a_tier_that_fits_in_memory_is_plain_memory_and_a_larger_one_a_mapped_file(monkeypatch):
    kv = filled_kv()
    assert HostTier(kv, 16).stats()["storage"] == "host memory"
    tier_bytes = 16 * SHAPE.bytes_per_block(4, torch.float32)
    monkeypatch.setattr(host_tier, "available_memory_bytes", lambda device: tier_bytes)
    assert HostTier(kv, 16).stats()["storage"] == "mapped file"  # over half of what is free


@pytest.mark.parametrize("storage", ["host memory", "mapped file"])
def test_blocks_written_and_read_back_are_the_same_kv_whatever_their_order(storage, monkeypatch):
    if storage == "mapped file":
        monkeypatch.setattr(host_tier, "available_memory_bytes", lambda device: 0)
    kv = filled_kv()
    tier = HostTier(kv, 20)
    assert tier.storage == storage
    rng = random.Random(0)
    for _ in range(20):
        # Runs on both sides, runs on one side only, and scattered blocks.
        n = rng.randint(1, 8)
        start = rng.randrange(0, 24 - n)
        device = list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(24), n)
        host = list(range(2, 2 + n)) if rng.random() < 0.5 else rng.sample(range(20), n)
        want_k, want_v = kv.k[:, device].clone(), kv.v[:, device].clone()
        tier.write(device, host)
        assert torch.equal(tier.k[:, host], want_k) and torch.equal(tier.v[:, host], want_v)
        kv.k[:, device] = 0.0
        kv.v[:, device] = 0.0
        back = rng.sample(range(24), n)  # loaded into other device blocks
        tier.read(host, back)
        assert torch.equal(kv.k[:, back], want_k) and torch.equal(kv.v[:, back], want_v)
    assert tier.blocks_written == tier.blocks_read > 0
