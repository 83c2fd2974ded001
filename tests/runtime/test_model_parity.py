"""The native model runner against transformers on the same weights, in float32.

Each architecture runs four ways: one prefill; a cached prefix then the rest extended (the
prefix ending inside a block and on a block boundary); prefill then token-by-token decode;
several sequences of different lengths packed in one batch (prefills, extends after a cached
prefix and decodes together) with their blocks shuffled in the pool.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import (
    KINDS,
    LONGROPE_ORIGINAL,
    load_reference,
    make_tiny_model,
    reference_greedy,
    stepped_engine,
)

from radixlang.model_files import load_model_files
from radixlang.runtime.model_runner import ModelRunner, SequenceInput

ATOL = 2e-4


class ShuffledBlocks:
    """Hands out the pool's blocks in a random order."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


class Case:
    """A runner and transformers' model on the same weights, with some token sequences."""

    def __init__(
        self, folder, prompts: list[list[int]], block_size: int = 16, device: str = "cpu"
    ) -> None:
        self.runner = ModelRunner(folder, block_size=block_size, num_blocks=96, device=device)
        self.hf = load_reference(self.runner.files.path)
        self.prompts = prompts
        self.blocks = ShuffledBlocks(96, seed=block_size)

    def table(self, tokens: int) -> list[int]:
        return self.blocks.take(-(-tokens // self.runner.block_size))

    def reference(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float().to(self.runner.device)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: make_tiny_model(kind, root / kind, seed=i) for i, kind in enumerate(KINDS)}


def tiny_case(folders, kind: str, block_size: int = 16, device: str = "cpu") -> Case:
    rng = random.Random(kind)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in (37, 20, 9, 29)]
    return Case(folders[kind], prompts, block_size, device)


@pytest.fixture(scope="module")
def default_case():
    files = load_model_files()
    tokenizer = files.load_tokenizer()
    texts = [
        "The capital of France is Paris. The capital of Germany is Berlin, and of Italy, Rome.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Once upon a time, in a small village by the sea,",
        "Question: what is 12 times 12? Answer: 144. Question: what is 7 times 8? Answer:",
    ]
    return Case(files, [tokenizer(t)["input_ids"] for t in texts])


def check_prefill(case: Case, all_positions: bool) -> None:
    ids = case.prompts[0]
    ref = case.reference(ids)
    vocab = ref.shape[1]
    top = vocab if all_positions else 1
    seq = SequenceInput(ids, 0, case.table(len(ids)), return_logprobs=True, top_logprobs=top)
    out = case.runner.forward([seq])
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    want = ref_logprobs[:-1].gather(1, torch.tensor(ids[1:], device=ref.device)[:, None]).squeeze(1)
    torch.testing.assert_close(out.prompt_logprobs[0], want, atol=ATOL, rtol=0)
    values, token_ids = out.prompt_top_logprobs[0]
    if all_positions:  # every position's whole distribution
        got = torch.empty_like(values).scatter_(1, token_ids, values)
        torch.testing.assert_close(got, ref_logprobs, atol=ATOL, rtol=0)
    else:  # the same argmax at every position
        assert token_ids[:, 0].tolist() == ref.argmax(-1).tolist()
        torch.testing.assert_close(values[:, 0], ref_logprobs.max(-1).values, atol=ATOL, rtol=0)


def check_prefix_then_extend(case: Case, prefix: int) -> None:
    ids = case.prompts[0]
    ref = case.reference(ids)
    table = case.table(len(ids))
    first = case.runner.forward([SequenceInput(ids[:prefix], 0, table)])
    torch.testing.assert_close(first.logits[0], ref[prefix - 1], atol=ATOL, rtol=0)
    rest = SequenceInput(ids[prefix:], prefix, table, return_logprobs=True)
    out = case.runner.forward([rest])
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)
    want = torch.log_softmax(ref[prefix:-1], -1).gather(
        1, torch.tensor(ids[prefix + 1 :], device=ref.device)[:, None]
    )
    torch.testing.assert_close(out.prompt_logprobs[0], want.squeeze(1), atol=ATOL, rtol=0)


def check_decode(case: Case) -> None:
    ids = case.prompts[1]
    ref = case.reference(ids)
    table = case.table(len(ids))
    case.runner.forward([SequenceInput(ids[:3], 0, table)])
    for pos in range(3, len(ids)):
        out = case.runner.forward([SequenceInput(ids[pos : pos + 1], pos, table)])
        torch.testing.assert_close(out.logits[0], ref[pos], atol=ATOL, rtol=0, msg=f"pos {pos}")


def check_packed_batch(case: Case) -> None:
    a, b, c, d = case.prompts
    tables = [case.table(len(p)) for p in case.prompts]
    # Cache a prefix of b (ending mid-block) and all but the last token of c.
    case.runner.forward([SequenceInput(b[:11], 0, tables[1]), SequenceInput(c[:-1], 0, tables[2])])
    seqs = [
        SequenceInput(c[-1:], len(c) - 1, tables[2]),  # a decode, given first
        SequenceInput(a, 0, tables[0], return_logprobs=True),  # a whole prefill
        SequenceInput(b[11:], 11, tables[1]),  # an extend after a cached prefix
        SequenceInput(d[:1], 0, tables[3]),  # a one-token prompt
    ]
    out = case.runner.forward(seqs)
    wants = [case.reference(c)[-1], case.reference(a)[-1], case.reference(b)[-1]]
    wants.append(case.reference(d[:1])[-1])
    for row, want in enumerate(wants):
        torch.testing.assert_close(out.logits[row], want, atol=ATOL, rtol=0, msg=f"row {row}")
    ref_a = torch.log_softmax(case.reference(a)[:-1], -1).gather(
        1, torch.tensor(a[1:], device=case.runner.device)[:, None]
    )
    torch.testing.assert_close(out.prompt_logprobs[1], ref_a.squeeze(1), atol=ATOL, rtol=0)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[1] is None


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_match_transformers(tiny_folders, kind):
    case = tiny_case(tiny_folders, kind)
    check_prefill(case, all_positions=True)
    check_prefix_then_extend(case, prefix=13)
    check_prefix_then_extend(case, prefix=16)
    check_decode(case)
    check_packed_batch(case)


@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope", "gemma3", "qwen3_moe", "mixtral"])
def test_greedy_tokens_match_transformers_on_32_prompts(tiny_folders, kind):
    """The engine's greedy continuations token for token as transformers' ``generate``: 8
    prompts first, then all 32 in one batch (half of them sharing a prefix with another, the
    first 8 whole prompts with the cache where the model has no window on every layer). Every
    prompt is longer than phi3_longrope's original context: both run on the long factors."""
    rng = random.Random(f"greedy-{kind}")
    heads = [[rng.randrange(3, 160) for _ in range(20)] for _ in range(4)]
    prompts = []
    for i in range(32):
        head = heads[i % 4][: rng.randrange(LONGROPE_ORIGINAL + 1, 21)] if i % 2 else []
        tail = [rng.randrange(3, 160) for _ in range(rng.randrange(LONGROPE_ORIGINAL + 1, 30))]
        prompts.append(head + tail)
    reference = load_reference(tiny_folders[kind])
    want = [reference_greedy(reference, p, 10) for p in prompts]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
    eng = stepped_engine(tiny_folders[kind])
    first = eng.generate(prompts[:8], [greedy] * 8)
    assert [r.output_ids for r in first] == want[:8]
    got = eng.generate(prompts, [greedy] * 32)
    assert [r.output_ids for r in got] == want
    if eng.runner.sliding_window is None:
        assert sum(r.cached_tokens for r in got) > 0
    eng.check_integrity()


def test_block_size_other_than_16(tiny_folders):
    case = tiny_case(tiny_folders, "llama", block_size=5)
    check_prefix_then_extend(case, prefix=12)
    check_decode(case)
    check_packed_batch(case)


def test_default_model_prefill_matches_with_same_argmax(default_case):
    check_prefill(default_case, all_positions=False)


def test_default_model_prefix_then_extend(default_case):
    check_prefix_then_extend(default_case, prefix=13)
    check_prefix_then_extend(default_case, prefix=16)


def test_default_model_decode(default_case):
    check_decode(default_case)


def test_default_model_packed_shuffled_batch(default_case):
    check_packed_batch(default_case)


# qwen3: q/k norms; gemma3: a query scale apart from head_dim's and windowed layers beside
# global ones; phi3_longrope: partial rotary.
@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3_longrope"])
def test_triton_path_matches_torch_path_through_the_model(tiny_folders, monkeypatch, kind):
    """The whole forward pass with the Triton kernels (interpreted on CPU) as with torch's."""
    case = tiny_case(tiny_folders, kind)
    a, b, _, _ = case.prompts
    ta, tb = case.table(len(a)), case.table(len(b))
    batches = [
        [SequenceInput(a[:20], 0, ta), SequenceInput(b[:6], 0, tb)],
        [SequenceInput(a[20:], 20, ta), SequenceInput(b[6:7], 6, tb)],
    ]
    torch_out = [case.runner.forward(batch).logits for batch in batches]
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    triton_out = [case.runner.forward(batch).logits for batch in batches]
    for want, got in zip(torch_out, triton_out, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_models_on_cuda_match_transformers(tiny_folders, kind):
    """The same checks with the model on the GPU (Triton kernels), transformers on the CPU."""
    case = tiny_case(tiny_folders, kind, device="cuda")
    check_prefix_then_extend(case, prefix=13)
    check_decode(case)
    check_packed_batch(case)
