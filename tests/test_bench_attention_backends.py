"""benchmarks/bench_attention_backends.py on a CPU: it skips cleanly, and the inputs it gives
FlashInfer (page table, paged prefix + new tokens) mean what the project's kernels read.

The timing itself needs a CUDA GPU and flashinfer (scripts/gpu_checks.sh runs it)."""

import importlib.util
import json
import os
import subprocess
import sys

import torch
from bench_module import BENCH, load

from radixlang.kernels import reference


def test_bench_attention_backends_skips_cleanly_without_a_gpu(tmp_path):
    # Run as the script is run, with every GPU hidden, so the test means the same on a GPU machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    script = BENCH / "bench_attention_backends.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "bench_attention_backends.json").read_text())
    assert "no CUDA GPU" in saved["skipped"]
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer is not installed" in saved["skipped"]
    assert "cases" not in saved and saved["layout"]["copy_needed"] is False
    assert {"heads", "kv_heads", "head_dim"} <= saved["shape"].keys()
    assert saved["machine"]["torch"] == torch.__version__
    assert "skipped" in proc.stderr
    if saved["plot"].startswith("placeholder"):
        assert (tmp_path / "bench_attention_backends.png").stat().st_size > 0


def test_flashinfer_page_table_lists_each_sequences_blocks_in_order():
    bench = load("bench_attention_backends")
    gen = torch.Generator().manual_seed(0)
    lens = [5, 16, 33, 1]
    cache, tables = bench.paged_batch(lens, 16, 2, 8, gen, "cpu", torch.float32)
    indptr, indices, last = bench.flashinfer_page_table(tables, torch.tensor(lens), 16)
    assert indptr.tolist() == [0, 1, 2, 5, 6] and last.tolist() == [5, 16, 1, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    flat_k = cache.k.view(-1, 2, 8)
    wanted = []
    for row, n in enumerate(lens):
        want = torch.stack([flat_k[tables[row, p // 16] * 16 + p % 16] for p in range(n)])
        # The sequence as FlashInfer reads it: its pages in order, the last one partly.
        pages = indices[indptr[row] : indptr[row + 1]].long()
        assert torch.equal(cache.k[pages].reshape(-1, 2, 8)[:n], want)
        wanted.append(want)
    slots = bench.token_slots(tables, [0] * len(lens), lens, 16)
    assert torch.equal(flat_k[slots], torch.cat(wanted))


def test_extend_inputs_give_the_paged_causal_attention_flashinfer_computes():
    bench = load("bench_attention_backends")
    gen = torch.Generator().manual_seed(1)
    shape = {"heads": 6, "kv_heads": 2, "head_dim": 8}
    batch, new, prefix, bs = 2, 7, 10, 4
    x = bench.extend_inputs(batch, new, prefix, shape, bs, gen, "cpu", torch.float32)
    scale = 8**-0.5
    got = reference.extend_attention(
        x["q"], x["k_new"], x["v_new"], x["cache"], x["block_tables"], x["prefix_lens"],
        x["extend_lens"], scale, host_lens=x["host_lens"],
    )  # fmt: skip
    # FlashInfer's semantics, densely: every key from the pages, causal aligned bottom-right.
    indptr, indices, last = bench.flashinfer_page_table(x["block_tables"], x["kv_lens"], bs)
    for row in range(batch):
        pages = indices[indptr[row] : indptr[row + 1]].long()
        total = (len(pages) - 1) * bs + int(last[row])  # all but the last page are full
        assert total == prefix + new
        k = x["cache"].k[pages].reshape(-1, 2, 8)[:total].repeat_interleave(3, dim=1)
        v = x["cache"].v[pages].reshape(-1, 2, 8)[:total].repeat_interleave(3, dim=1)
        q = x["q"][row * new : (row + 1) * new]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = torch.arange(total)[None, :] <= prefix + torch.arange(new)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", probs, v)
        torch.testing.assert_close(got[row * new : (row + 1) * new], want)


def test_extend_case_parses_batch_new_and_prefix():
    bench = load("bench_attention_backends")
    assert bench.extend_case("8x256+0") == (8, 256, 0)
    assert bench.extend_case("1X1000+1000") == (1, 1000, 1000)
    for bad in ("8x256", "0x5+0", "ax1+2"):
        try:
            bench.extend_case(bad)
        except Exception as exc:
            assert "BATCHxNEW+PREFIX" in str(exc) or ">= 1" in str(exc), exc
        else:
            raise AssertionError(f"{bad!r} was accepted")
