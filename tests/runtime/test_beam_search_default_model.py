"""Beam search on the default model (float32) equals transformers' ``generate(num_beams=k,
do_sample=False)``, with the beams' KV blocks shared (the saving is printed: run with -s)."""

from __future__ import annotations

import pytest
import torch

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime.engine import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "Name three colors.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "How many legs does a spider have?",
    "Suggest a title for a short story about a robot.",
]
MAX_NEW = 16
WIDTHS = (2, 4)


@pytest.fixture(scope="module")
def files():
    return load_model_files(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def prompts(files):
    tok = files.load_tokenizer()
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
        )
        for q in QUESTIONS
    ]


def reference(files, prompts, eos: list[int]) -> dict[tuple[int, int], list[int]]:
    """transformers' beams for every prompt, the prompts batched with left padding: the same
    beams as one prompt at a time (checked when this test was written), in a third of the time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        files.path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    n = max(map(len, prompts))
    ids = torch.tensor([[eos[0]] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    want = {}
    for width in WIDTHS:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                num_beams=width,
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        for i in range(len(prompts)):
            seq = out[i, n:].tolist()
            ends = [j for j, t in enumerate(seq) if t in eos]
            want[width, i] = seq[: ends[0] + 1] if ends else seq  # padding after its end
    return want


@pytest.mark.slow
def test_beams_on_the_default_model_equal_transformers(files, prompts):
    # float32: the reference is float32 transformers ("auto" may pick bfloat16).
    eng = Engine(
        files, num_blocks=512, dtype="float32", background=False, check_integrity_every_step=True
    )
    want = reference(files, prompts, sorted(eng.eos_token_ids))
    params = {"temperature": 0, "max_new_tokens": MAX_NEW}
    handles = {
        (w, i): eng.submit(p, {**params, "beam_width": w})
        for w in WIDTHS
        for i, p in enumerate(prompts)
    }
    # Peak over the run, per search: distinct blocks its beams hold vs one table per beam.
    shared: dict[int, int] = {}
    private: dict[int, int] = {}
    report = None  # the memory report at the step with the most shared blocks
    while not all(h.done for h in handles.values()):
        eng.step()
        now = eng.memory_report()
        if report is None or now.blocks_shared > report.blocks_shared:
            report = now
        groups: dict[int, list] = {}
        for r in eng.scheduler.running:
            if r.beam is not None:
                groups.setdefault(id(r.beam), []).append(r)
        for key, beams in groups.items():
            shared[key] = max(shared.get(key, 0), len({b for r in beams for b in r.blocks}))
            private[key] = max(private.get(key, 0), sum(len(r.blocks) for r in beams))
    got = {key: h.result().output_ids for key, h in handles.items()}
    assert got == want
    saving = 1 - sum(shared.values()) / sum(private.values())
    print(
        f"\nbeam KV blocks (block size {eng.pool.block_size}, {MAX_NEW} new tokens, widths "
        f"{WIDTHS}): peak {sum(shared.values())} shared vs {sum(private.values())} with a "
        f"private copy per beam: {saving:.1%} saved"
    )
    assert saving > 0.3
    # The memory report sees it too: blocks held by several beams, and more logical tokens
    # than live ones.
    assert report is not None and report.blocks_shared > 0 and report.sharing > 1.5
    print(f"memory report at the peak: {report.blocks_shared} shared blocks, sharing "
          f"{report.sharing:.2f}x, allocated/live {report.allocated_per_live:.3f}")  # fmt: skip
    eng.check_integrity()
    assert eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_blocks
