"""Free text before a plain-text marker skips the grammar's mask at clean points
(``radixlang/constrain/free_text.py``): the masks it gives are bit for bit the matcher's own,
at every step of random walks that write the marker's pieces, newlines, multi-byte characters
and the marker itself, then calls."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixlang.constrain import compile_grammar
from radixlang.constrain.tool_calls import call_grammar, free_text_marker
from radixlang.constrain.tool_formats import DEFAULT_FORMAT, HERMES, ToolFormat

TOOLS = [("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"]})]  # fmt: skip
FUNCTION_TAG = ToolFormat(
    "function-tag", "<function=", (("name", ""), ("lit", ">"), ("args", "")),
    "</function><function=", "</function>", "\n\n",
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from radixlang.model_files import load_model_files

    return load_model_files().load_tokenizer()


def test_only_the_lazy_plain_marker_grammar_is_recognised():
    assert free_text_marker(call_grammar("auto", TOOLS, True, None, HERMES)) == "<tool_call>"
    assert free_text_marker(call_grammar("auto", TOOLS, True, None, FUNCTION_TAG)) == "<function="
    assert free_text_marker(call_grammar("required", TOOLS, True, None, HERMES)) is None
    assert free_text_marker(call_grammar("auto", TOOLS, True, None, DEFAULT_FORMAT)) is None
    edited = call_grammar("auto", TOOLS, True, None, HERMES).replace("TEXT: /(?s:.+)/", "TEXT: /x/")
    assert free_text_marker(edited) is None


@pytest.mark.parametrize("fmt", [HERMES, FUNCTION_TAG], ids=["hermes", "function-tag"])
def test_skipped_masks_are_the_matchers_own_at_every_step(tokenizer, fmt):
    grammar = compile_grammar("grammar", call_grammar("auto", TOOLS, True, None, fmt),
                              tokenizer, len(tokenizer), [tokenizer.eos_token_id])  # fmt: skip
    assert grammar.free_text is not None
    pieces = [
        "\n",
        "<",
        "function",
        "tool",
        "_",
        "call",
        ">",
        "=",
        "é",
        "日本",
        "🙂",
        " a",
        fmt.trigger,
        fmt.text_before + fmt.trigger,
        "x" + fmt.trigger,
        "\n\n",
    ]
    favoured = sorted({t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False)})
    rng = random.Random(0)
    skipped = checked = called = 0
    for walk in range(24):
        constraint = grammar.new_constraint()
        # Half the walks write some text, then the marker as the format writes it after text.
        plan = tokenizer.encode("x" + fmt.text_before + fmt.trigger, add_special_tokens=False)
        at = rng.randrange(1, 20) if walk % 2 else None
        for step in range(60):
            mask = constraint.allowed_mask()
            skipped += constraint._free_words() is not None
            bits = torch.frombuffer(bytearray(constraint.matcher.compute_bitmask()),
                                    dtype=torch.uint8)  # fmt: skip
            full = torch.from_numpy(np.unpackbits(bits.numpy(), bitorder="little"))
            full = full.bool()[: mask.shape[0]]
            assert torch.equal(mask, full), walk
            checked += 1
            allowed = mask.nonzero().flatten().tolist()
            if not allowed or constraint.is_finished():
                break
            near = [t for t in favoured if mask[t]]
            token = rng.choice(near if near and rng.random() < 0.7 else allowed)
            if at is not None and at <= step < at + len(plan) and mask[plan[step - at]]:
                token = plan[step - at]
            if token == tokenizer.eos_token_id:
                break
            constraint.advance(token)
        called += not constraint.free.free
    # The skip happened often, and always gave the matcher's bits; walks reached the calls.
    assert skipped > checked // 4 and called >= 3, (skipped, checked, called)
