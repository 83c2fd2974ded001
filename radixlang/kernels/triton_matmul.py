"""A batch-invariant matmul in Triton, for deterministic inference on GPUs: ``y = x @ w.T``.

cuBLAS picks its kernel, its tiles and whether to split the sum over K (split-K) by the shape
of the call, so a row's result changes with the number of rows beside it. Here every output
tile is one program with the same fixed tile sizes whatever M is, walking K from 0 up in
``BLOCK_K`` steps and accumulating in float32: a row's products are summed in one order, and
rows past M are masked loads of zeros that touch no other row's sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlang.kernels.triton_decode_attention import dot_precision, upcast_dots

# Fixed tile sizes: never chosen per shape (that choice is what would break invariance).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` times ``weight`` ``[N, K]`` transposed (+ ``bias`` ``[N]``), in
    ``x``'s dtype; every row's result independent of the others and of their number."""
    lead = x.shape[:-1]
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns; the weight takes {k}")
    rows = x.reshape(-1, k).contiguous()
    w = weight.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _matmul_kernel[grid](
            rows,
            w,
            bias if bias is not None else w,
            y,
            m,
            n,
            k,
            rows.stride(0),
            w.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            UPCAST=upcast_dots(rows),
            PRECISION=dot_precision(rows),
            num_warps=4,
        )
    return y.view(*lead, n)
