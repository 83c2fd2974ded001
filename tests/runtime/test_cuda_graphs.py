"""CUDA graphs for decode-only forwards (runtime/cuda_graphs.py and ModelRunner's use of them).

Without a GPU: the capture sizes, the static inputs' fill, and the padding semantics (the
model run eagerly on the padded static inputs, with the Triton kernels under Triton's
interpreter, as a graph would run them). The ``gpu`` tests replay real graphs against eager
runs.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from tiny_models import make_tiny_model

from radixlang.runtime.cuda_graphs import (
    PADDING_SLOT,
    DecodeGraphInputs,
    DecodeGraphRunner,
    capture_sizes,
    decode_table_width,
    padded_size,
)
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.model_runner import BatchError, ModelRunner, SequenceInput

# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before any test module loads.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="Triton interpreter off (a GPU is present); the gpu tests cover this"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE = 4
NUM_BLOCKS = 300
# Long enough that the static block table (256 blocks of 4) spans several KV partitions of the
# Triton decode kernel (64 blocks each): the padded run takes its split path and reduce.
MAX_CONTEXT = 1024
ATOL = 2e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-graphs")
    return {
        kind: make_tiny_model(kind, root / kind, seed=i, max_position_embeddings=MAX_CONTEXT)
        for i, kind in enumerate(("llama", "mistral_window", "qwen3"))
    }


# --- capture sizes ---------------------------------------------------------------------------


def test_capture_sizes():
    sizes = capture_sizes()
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:]))
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest batch itself is captured
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("n", "want"),
    [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, 24), (256, 256)],
)
def test_padded_size(n, want):
    assert padded_size(n, capture_sizes()) == want


def test_padded_size_above_the_largest_is_none():
    assert padded_size(257, capture_sizes()) is None
    assert padded_size(21, capture_sizes(20)) is None
    with pytest.raises(ValueError):
        padded_size(0, capture_sizes())


def test_decode_table_width():
    assert decode_table_width(1024, 4, 300, None) == 256
    assert decode_table_width(1024, 4, 100, None) == 100  # no table outgrows the pool...
    assert decode_table_width(1024, 4, 100, 8) == 256  # ...unless a window releases blocks
    assert decode_table_width(1000, 16, 10**6, None) == 63


# --- fill ------------------------------------------------------------------------------------


def decode_batch(n: int, width: int, seed: int) -> ForwardBatch:
    """A decode-only batch of ``n`` rows with made-up (nonzero) values."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, width * BLOCK_SIZE, (n,), generator=gen, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.randint(1, 100, (n,), generator=gen),
        positions=prefix.long(),
        slot_mapping=torch.randint(0, 1000, (n,), generator=gen),
        block_tables=torch.randint(1, 50, (n, width), generator=gen, dtype=torch.int32),
        prefix_lens=prefix,
        extend_lens=torch.ones(n, dtype=torch.int32),
        seq_lens=prefix + 1,
        num_extend_seqs=0,
        num_extend_tokens=0,
        host_prefix_lens=prefix.tolist(),
        host_extend_lens=[1] * n,
    )


def buffers(inputs: DecodeGraphInputs) -> list[torch.Tensor]:
    return [
        inputs.input_ids,
        inputs.positions,
        inputs.slot_mapping,
        inputs.block_tables,
        inputs.seq_lens,
        inputs.prefix_lens,
        inputs.extend_lens,
        inputs.logit_rows,
    ]


def check_padding_rows(inputs: DecodeGraphInputs, n: int) -> None:
    assert (inputs.input_ids[n:] == 0).all()
    assert (inputs.positions[n:] == 0).all()
    assert (inputs.slot_mapping[n:] == PADDING_SLOT).all()
    assert (inputs.seq_lens[n:] == 1).all()
    assert (inputs.prefix_lens[n:] == 0).all()
    assert (inputs.block_tables[n:] == 0).all()


def test_fill_copies_the_rows_and_pads_in_place():
    inputs = DecodeGraphInputs(max_batch=8, max_blocks=6, device="cpu")
    check_padding_rows(inputs, 0)  # fresh buffers are all padding
    assert (inputs.extend_lens == 1).all()
    assert inputs.logit_rows.tolist() == list(range(8))
    pointers = [t.data_ptr() for t in buffers(inputs)]

    wide = decode_batch(5, width=6, seed=0)
    inputs.fill(wide)
    assert torch.equal(inputs.input_ids[:5], wide.input_ids)
    assert torch.equal(inputs.positions[:5], wide.positions)
    assert torch.equal(inputs.slot_mapping[:5], wide.slot_mapping)
    assert torch.equal(inputs.seq_lens[:5], wide.seq_lens)
    assert torch.equal(inputs.prefix_lens[:5], wide.prefix_lens)
    assert torch.equal(inputs.block_tables[:5], wide.block_tables)
    check_padding_rows(inputs, 5)

    # A smaller, narrower batch next: the old rows and the old table's right part are gone.
    narrow = decode_batch(3, width=2, seed=1)
    inputs.fill(narrow)
    assert torch.equal(inputs.input_ids[:3], narrow.input_ids)
    assert torch.equal(inputs.slot_mapping[:3], narrow.slot_mapping)
    assert torch.equal(inputs.seq_lens[:3], narrow.seq_lens)
    assert torch.equal(inputs.block_tables[:3, :2], narrow.block_tables)
    assert (inputs.block_tables[:3, 2:] == 0).all()
    check_padding_rows(inputs, 3)

    inputs.fill(decode_batch(8, width=6, seed=2))  # a full batch: no padding rows
    assert [t.data_ptr() for t in buffers(inputs)] == pointers  # never reallocated
    assert (inputs.extend_lens == 1).all()

    view = inputs.batch(4)
    assert view.num_seqs == 4 and view.num_tokens == 4 and view.num_extend_seqs == 0
    assert view.block_tables.shape == (4, 6)
    assert view.block_tables.data_ptr() == inputs.block_tables.data_ptr()


def test_fill_refuses_what_does_not_fit():
    inputs = DecodeGraphInputs(max_batch=4, max_blocks=3, device="cpu")
    with pytest.raises(ValueError, match="largest captured size"):
        inputs.fill(decode_batch(5, width=2, seed=0))
    with pytest.raises(ValueError, match="wide"):
        inputs.fill(decode_batch(2, width=4, seed=0))
    extend = decode_batch(2, width=2, seed=0)
    extend.num_extend_seqs = 1
    with pytest.raises(ValueError, match="decodes"):
        inputs.fill(extend)
    with pytest.raises(ValueError):
        inputs.batch(5)


# --- padding semantics, eagerly on the CPU ---------------------------------------------------


def prefill(runner: ModelRunner, lengths: list[int], seed: int) -> list[SequenceInput]:
    """Cache a random prompt of each length (on the runner's default kernels) and return each
    one's next decode step: the token after it, at that position."""
    rng = random.Random(seed)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    decodes = []
    for length in lengths:
        table = [free.pop() for _ in range(length // runner.block_size + 1)]
        prompt = [rng.randrange(runner.vocab_size) for _ in range(length)]
        runner.forward([SequenceInput(prompt, 0, table)])
        decodes.append(SequenceInput([rng.randrange(runner.vocab_size)], length, table))
    return decodes


@interpreted
@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
def test_padded_static_inputs_give_the_unpadded_results(folders, kind, monkeypatch):
    """The model on the padded static inputs, as a captured graph runs it: the real rows'
    logits and K/V are those of the unpadded batch and the padding rows write nothing."""
    runner = ModelRunner(folders[kind], num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert not runner.cuda_graphs
    decodes = prefill(runner, [3, 9, 16, 30, 47], seed=len(kind))
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")  # as on a GPU: the store drops slot -1
    k_before, v_before = runner.kv.k.clone(), runner.kv.v.clone()
    want = runner.forward(decodes).logits
    k_want, v_want = runner.kv.k.clone(), runner.kv.v.clone()
    runner.kv.k.copy_(k_before)
    runner.kv.v.copy_(v_before)

    arch = runner.model.arch
    width = decode_table_width(arch.max_context, BLOCK_SIZE, NUM_BLOCKS, arch.sliding_window)
    assert width == MAX_CONTEXT // BLOCK_SIZE
    inputs = DecodeGraphInputs(max_batch=8, max_blocks=width, device="cpu")
    built = runner._build_batch(decodes, [])
    assert built is not None
    inputs.fill(built[0])
    size = padded_size(len(decodes), capture_sizes(8))
    assert size == 8
    batch = inputs.batch(size)
    assert batch.block_tables.shape == (8, width)  # wider than the unpadded batch's 12
    got = runner.model.forward(batch, runner.kv, inputs.logit_rows[:size])

    assert got.shape == (8, runner.vocab_size)
    torch.testing.assert_close(got[: len(decodes)], want, atol=1e-5, rtol=0)
    assert torch.isfinite(got).all()  # padding rows too, though they are dropped
    # The cache changed at the real rows' slots only, to what the unpadded batch wrote.
    layers, kv_heads, dim = runner.kv.shape.num_layers, runner.kv.shape.kv_heads, arch.head_dim
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[built[0].slot_mapping] = True
    for got_cache, before, wanted in (
        (runner.kv.k, k_before, k_want),
        (runner.kv.v, v_before, v_want),
    ):
        got_slots = got_cache.view(layers, -1, kv_heads, dim)
        assert torch.equal(
            got_slots[:, ~written], before.view(layers, -1, kv_heads, dim)[:, ~written]
        )
        want_slots = wanted.view(layers, -1, kv_heads, dim)[:, written]
        torch.testing.assert_close(got_slots[:, written], want_slots, atol=1e-5, rtol=0)


class EagerGraph:
    """A captured graph's stand-in on the CPU: replay runs the forward a capture records, on
    the same static buffers."""

    def __init__(self, runner: ModelRunner, inputs: DecodeGraphInputs, logits, size: int):
        self.runner, self.inputs, self.logits, self.size = runner, inputs, logits, size
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        batch, rows = self.inputs.batch(self.size), self.inputs.logit_rows[: self.size]
        self.logits[: self.size].copy_(self.runner.model.forward(batch, self.runner.kv, rows))


@interpreted
def test_runner_replays_exactly_the_decode_batches_that_fit(folders, monkeypatch):
    """ModelRunner's choice between a replay and the eager path, with stand-in graphs."""
    runner, ref = (
        ModelRunner(folders["llama"], num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        for _ in range(2)
    )
    decodes = prefill(runner, [3, 9, 16, 30, 5, 12, 7, 1, 2], seed=3)
    assert prefill(ref, [3, 9, 16, 30, 5, 12, 7, 1, 2], seed=3) == decodes
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    # Graphs up to 8 rows whose tables hold 6 blocks (24 tokens), as a capture would leave them.
    inputs = DecodeGraphInputs(max_batch=8, max_blocks=6, device="cpu")
    logits = torch.empty(8, runner.vocab_size)
    fakes = {size: EagerGraph(runner, inputs, logits, size) for size in capture_sizes(8)}
    runner.cuda_graphs, runner.cuda_graph_max_batch = True, 8
    runner._graphs = DecodeGraphRunner(inputs, fakes, logits)
    assert runner.describe()["cuda_graph_sizes"] == [1, 2, 4, 8]

    def replays() -> dict[int, int]:
        return {size: fake.replays for size, fake in fakes.items() if fake.replays}

    short = [decodes[i] for i in (0, 1, 4, 5, 6)]  # prefixes under 24 tokens
    out = runner.forward(short)
    assert replays() == {8: 1}
    assert out.logits.data_ptr() == logits.data_ptr()  # a view of the output buffer
    assert out.prompt_logprobs == [None] * 5 and out.prompt_top_logprobs == [None] * 5
    torch.testing.assert_close(out.logits, ref.forward(short).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(runner.forward(short[:1]).logits, ref.forward(short[:1]).logits)
    assert replays() == {8: 1, 1: 1}

    eager = [
        decodes[:8],  # a prefix of 30 tokens: wider than the graphs' tables
        short + [decodes[7]] * 4,  # 9 rows: more than the largest graph
        [SequenceInput(short[0].tokens, short[0].prefix_len, short[0].block_table, True)],
        [SequenceInput([1, 2], 0, [50]), short[1]],  # an extend
    ]
    for batch in eager:
        torch.testing.assert_close(runner.forward(batch).logits, ref.forward(batch).logits)
    assert replays() == {8: 1, 1: 1}
    monkeypatch.setenv("RADIXLANG_KERNELS", "torch")  # kernels switched: no replay either
    runner.forward(short)
    assert replays() == {8: 1, 1: 1}
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    with pytest.raises(BatchError, match="token ids"):  # a bad batch is refused as eagerly
        runner.forward([SequenceInput([10_000], 3, short[0].block_table)])


# --- the runner's switch ---------------------------------------------------------------------


def test_cuda_graphs_on_a_cpu_are_refused(folders):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(folders["llama"], num_blocks=8, block_size=BLOCK_SIZE, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        ModelRunner(folders["llama"], num_blocks=8, cuda_graph_max_batch=0)
    runner = ModelRunner(folders["llama"], num_blocks=8, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphRunner.capture(runner.model, runner.kv, [1, 2])
    with pytest.raises(ValueError, match="off"):
        runner.capture_cuda_graphs()


def test_cuda_graphs_are_off_on_a_cpu_by_default(folders, monkeypatch):
    runner = ModelRunner(folders["llama"], num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    off = ModelRunner(
        folders["llama"], num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cuda_graphs=False
    )
    assert runner.cuda_graphs is False and off.cuda_graphs is False
    info = runner.describe()
    assert info["cuda_graphs"] is False and info["cuda_graph_sizes"] == []

    def no_replay(host):
        raise AssertionError("a CPU runner must not try a graph")

    monkeypatch.setattr(runner, "run_decode", no_replay)
    decodes = prefill(runner, [5, 12], seed=0)
    assert prefill(off, [5, 12], seed=0) == decodes
    assert torch.equal(runner.forward(decodes).logits, off.forward(decodes).logits)


# --- on a GPU: real graphs -------------------------------------------------------------------


def cuda_runners(folder, max_batch: int = 16) -> tuple[ModelRunner, ModelRunner]:
    """Two runners on the same weights: CUDA graphs on (the default there) and off."""
    kwargs = dict(device="cuda", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    graphs = ModelRunner(folder, cuda_graph_max_batch=max_batch, **kwargs)
    eager = ModelRunner(folder, cuda_graphs=False, **kwargs)
    assert graphs.cuda_graphs and not eager.cuda_graphs
    return graphs, eager


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "mistral_window", "qwen3"])
def test_replayed_logits_match_eager_ones(folders, kind):
    graphs, eager = cuda_runners(folders[kind])
    lengths = [3, 9, 16, 30, 47, 5, 70, 12, 1, 33, 20, 8, 64, 2, 17, 40, 11, 6, 25, 50]
    decodes = prefill(graphs, lengths, seed=1)
    assert prefill(eager, lengths, seed=1) == decodes
    for n in (1, 3, 8, 13, 16, 20):  # exact sizes, padded ones, and one above the largest
        want = eager.forward(decodes[:n]).logits
        got = graphs.forward(decodes[:n]).logits
        assert got.shape == want.shape == (n, eager.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"batch of {n}")
        # Padding rows wrote nothing: both caches hold the same K/V.
        torch.testing.assert_close(graphs.kv.k, eager.kv.k, atol=ATOL, rtol=0)
        torch.testing.assert_close(graphs.kv.v, eager.kv.v, atol=ATOL, rtol=0)
    assert graphs.describe()["cuda_graph_sizes"] == [1, 2, 4, 8, 16]
    # A batch that asks for logprobs runs eagerly, and its result is the same.
    scored = [SequenceInput(s.tokens, s.prefix_len, s.block_table, True) for s in decodes[:3]]
    torch.testing.assert_close(
        graphs.forward(scored).logits, eager.forward(scored).logits, atol=ATOL, rtol=0
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
def test_greedy_decode_matches_without_graphs(folders, kind):
    """A few greedy steps of a batch that needs padding, crossing block boundaries, with an
    extend joining halfway (that step runs eagerly); the same tokens with graphs as without."""
    rng = random.Random(kind)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (5, 14, 3, 22, 9)]
    late = [rng.randrange(160) for _ in range(11)]
    outputs = []
    for runner in cuda_runners(folders[kind], max_batch=8):
        free = list(range(runner.num_blocks))
        tables = [free[i * 20 : (i + 1) * 20] for i in range(len(prompts) + 1)]
        seqs = [list(p) for p in prompts]
        out = runner.forward(
            [SequenceInput(p, 0, t) for p, t in zip(seqs, tables[:-1], strict=True)]
        )
        for seq, token in zip(seqs, out.logits.argmax(-1).tolist(), strict=True):
            seq.append(token)
        for step in range(8):
            batch = [
                SequenceInput(s[-1:], len(s) - 1, t)
                for s, t in zip(seqs, tables[: len(seqs)], strict=True)
            ]
            if step == 3:  # an extend joins: a mixed batch
                batch.append(SequenceInput(late, 0, tables[len(seqs)]))
                seqs.append(list(late))
            tokens = runner.forward(batch).logits.argmax(-1).tolist()
            for seq, token in zip(seqs, tokens, strict=True):
                seq.append(token)
        outputs.append(seqs)
    assert outputs[0] == outputs[1]
