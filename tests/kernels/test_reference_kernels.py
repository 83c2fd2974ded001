"""The torch path of the paged kernels against the naive dense reference."""

import pytest
import torch
from dense_attention import default_scale, dense_attention, make_paged_case

import radixlang.kernels as kernels
from radixlang.kernels import reference
from radixlang.kernels.layout import PagedKV, check_paged_kv

SHAPES = [  # (heads, kv_heads, head_dim, block_size)
    (8, 2, 16, 16),
    (6, 6, 8, 5),
    (4, 1, 32, 3),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_decode_matches_dense(heads, kv_heads, head_dim, block_size):
    lens = [1, 5, block_size, block_size + 1, 40]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, seed=heads)
    q = torch.randn(len(lens), heads, head_dim)
    scale = default_scale(head_dim)
    out = reference.decode_attention(
        q, case.cache, case.block_tables, torch.tensor(lens, dtype=torch.int32), scale
    )
    for row, n in enumerate(lens):
        want = dense_attention(q[row : row + 1], case.k[row], case.v[row], [n - 1], scale)
        torch.testing.assert_close(out[row : row + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget_sequences", [1, 2, 3])
def test_decode_in_sub_batches_matches_the_whole_batch(monkeypatch, dtype, budget_sequences):
    """A batch larger than the cache budget runs in sub-batches; the result does not change."""
    lens = [1, 5, 16, 17, 40, 33, 2, 48] * 3  # 24 sequences: 16-bit batches use bmm too
    case = make_paged_case(lens, 2, 8, 16, seed=3, dtype=dtype)
    q = torch.randn(len(lens), 4, 8, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    whole = reference.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    per_sequence = 2 * 3 * 16 * 2 * 8 * q.element_size()  # K and V of 3 blocks of 16 slots
    monkeypatch.setattr(reference, "DECODE_CHUNK_BYTES", budget_sequences * per_sequence)
    calls = []
    real = reference._decode_chunk
    monkeypatch.setattr(reference, "_decode_chunk", lambda *a: calls.append(1) or real(*a))
    split = reference.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    assert len(calls) == -(-len(lens) // budget_sequences)
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(split, whole, atol=atol, rtol=0)
    for row, n in enumerate(lens):
        want = dense_attention(q[row : row + 1], case.k[row], case.v[row], [n - 1], 0.3)
        torch.testing.assert_close(split[row : row + 1].double(), want, atol=atol * 10, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_extend_matches_dense(heads, kv_heads, head_dim, block_size):
    prefix_lens = [0, 3, block_size, 7, 0]
    extend_lens = [4, 1, 9, 2 * block_size + 1, 1]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, kv_heads, head_dim, block_size, seed=7)
    q = torch.randn(sum(extend_lens), heads, head_dim)
    k_new = torch.cat([k[p:] for k, p in zip(case.k, prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(case.v, prefix_lens, strict=True)])
    scale = default_scale(head_dim)
    out = reference.extend_attention(
        q,
        k_new,
        v_new,
        case.cache,
        case.block_tables,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        scale,
    )
    start = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        positions = list(range(p, p + e))
        want = dense_attention(q[start : start + e], case.k[row], case.v[row], positions, scale)
        torch.testing.assert_close(out[start : start + e].double(), want, atol=1e-5, rtol=1e-5)
        start += e


def test_extend_reads_the_prefix_from_the_cache_not_k_new():
    case = make_paged_case([10], 2, 8, 4)
    q = torch.randn(3, 4, 8)
    args = (case.cache, case.block_tables, torch.tensor([7]), torch.tensor([3]), 0.3)
    out = reference.extend_attention(q, case.k[0][7:], case.v[0][7:], *args)
    # Changing a prefix slot in the cache changes the result; the new tokens come from k_new.
    case.cache.k[case.block_tables[0, 0], 0] += 1.0
    assert not torch.allclose(
        out, reference.extend_attention(q, case.k[0][7:], case.v[0][7:], *args)
    )


def test_store_kv_writes_only_the_given_slots():
    cache = PagedKV(torch.zeros(4, 3, 2, 5), torch.zeros(4, 3, 2, 5))
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    slots = torch.tensor([11, 0, 4])
    reference.store_kv(k, v, slots, cache)
    flat_k, flat_v = cache.k.view(-1, 2, 5), cache.v.view(-1, 2, 5)
    torch.testing.assert_close(flat_k[slots], k)
    torch.testing.assert_close(flat_v[slots], v)
    untouched = [s for s in range(12) if s not in (11, 0, 4)]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


@pytest.mark.parametrize(
    "lens",
    [[33, 2], [1 + (7 * i) % 40 for i in range(18)]],
    ids=["small-batch-sdpa", "large-batch-block-diagonal"],
)
def test_bfloat16_decode_is_close_to_dense(lens):
    case = make_paged_case(lens, 2, 16, 16, dtype=torch.bfloat16)
    q = torch.randn(len(lens), 4, 16).bfloat16()
    out = reference.decode_attention(q, case.cache, case.block_tables, torch.tensor(lens), 0.25)
    assert out.dtype == torch.bfloat16
    for row, n in enumerate(lens):
        want = dense_attention(q[row : row + 1], case.k[row], case.v[row], [n - 1], 0.25)
        torch.testing.assert_close(out[row : row + 1].double(), want, atol=2e-2, rtol=2e-2)


def test_dispatch_follows_device_and_override(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("RADIXLANG_KERNELS", raising=False)
    assert kernels.use_triton(cpu) is False
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    assert kernels.use_triton(cpu) is True
    monkeypatch.setenv("RADIXLANG_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="RADIXLANG_KERNELS"):
        kernels.use_triton(cpu)


def test_check_paged_kv_refuses_mismatched_caches():
    with pytest.raises(ValueError, match="num_blocks"):
        check_paged_kv(PagedKV(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 2, 8)))
    with pytest.raises(ValueError, match="contiguous"):
        check_paged_kv(PagedKV(torch.zeros(2, 8, 1, 4).transpose(1, 3), torch.zeros(2, 4, 1, 8)))
