"""Phi-3 and Gemma 3 facts below the parity tests: the rotary embedding against transformers'
own functions (LongRoPE's factor sets and attention factor, partial rotary), which LongRoPE set
the runner uses for a sequence shorter than the original context, which layers are windowed
and with which rope, and the configs refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    LONGROPE_ORIGINAL,
    WINDOWS,
    load_reference,
    make_tiny_gemma3_multimodal,
    make_tiny_model,
    tiny_config,
)

from radixlang.model_files import UnsupportedModelError
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.models.llama import LlamaArch
from radixlang.runtime.models.rope import (
    apply_rotary,
    attention_scaling,
    cos_sin,
    inverse_frequencies,
)


@pytest.mark.parametrize("max_context", [256, LONGROPE_ORIGINAL])
def test_longrope_frequencies_and_scaling_are_transformers(max_context):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config("phi3_longrope", max_position_embeddings=max_context)
    arch = LlamaArch.from_config(config)
    assert arch.rotary_dim == 12  # 3/4 of 16
    # transformers' sets: short at initialisation, long for a sequence past the original.
    short, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=LONGROPE_ORIGINAL + 1)
    got = inverse_frequencies(arch.rotary_dim, arch.rope_parameters, max_context)
    # A context past the original: the long set; one within it: the short set (and no scale).
    torch.testing.assert_close(got, long if max_context > LONGROPE_ORIGINAL else short)
    assert attention_scaling(arch.rope_parameters, max_context) == pytest.approx(want_scale)
    assert (want_scale > 1.0) == (max_context > LONGROPE_ORIGINAL)


def test_partial_rotary_is_transformers():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 7, 4, 16).unbind(0)  # [tokens, heads, head_dim]
    inv_freq = inverse_frequencies(12, {"rope_theta": 100.0})
    positions = torch.arange(3, 10)
    cos, sin = cos_sin(inv_freq, positions, torch.float32, scaling=1.3)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1), k.transpose(0, 1), emb.cos() * 1.3, emb.sin() * 1.3, unsqueeze_dim=0
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), want_q.transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), want_k.transpose(0, 1))
    assert torch.equal(apply_rotary(q, cos, sin)[..., 12:], q[..., 12:])  # passed through


def test_a_short_longrope_sequence_runs_on_the_long_factors(tmp_path):
    """Documents the one difference from transformers: a sequence of at most the original
    context (4 tokens here, 8 the original) is computed on the long factors, as transformers
    computes it only once the sequence has grown past the original (see models/rope.py)."""
    folder = make_tiny_model("phi3_longrope", tmp_path / "phi3")
    runner = ModelRunner(folder, num_blocks=8, block_size=4)
    hf = load_reference(folder)
    ids = [5, 17, 42, 99]
    out = runner.forward([SequenceInput(ids, 0, [0], return_logprobs=True)])
    with torch.no_grad():
        short = hf(torch.tensor([ids])).logits[0, -1]
        rotary = hf.model.rotary_emb
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, seq_len=LONGROPE_ORIGINAL + 1)
        rotary.original_inv_freq.copy_(long)  # what transformers takes for a short sequence
        forced_long = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], forced_long, atol=2e-4, rtol=0)
    assert not torch.allclose(out.logits[0], short, atol=2e-4, rtol=0)


def test_which_layers_are_windowed_and_which_rope_they_take():
    phi = LlamaArch.from_config(tiny_config("phi3"))
    assert phi.layer_windows == (WINDOWS["phi3"],) * 2 and phi.sliding_window == WINDOWS["phi3"]
    assert phi.local_rope_parameters is None
    assert LlamaArch.from_config(tiny_config("phi3_longrope")).layer_windows == ()
    gemma = LlamaArch.from_config(tiny_config("gemma3"))
    window = WINDOWS["gemma3"]
    assert gemma.layer_windows == (window, None, window) and gemma.sliding_window is None
    assert gemma.rope_parameters["rope_theta"] == 1e6
    assert gemma.rope_parameters["rope_type"] == "linear"
    assert gemma.local_rope_parameters["rope_theta"] == 1e4
    assert gemma.attn_scale == 24**-0.5 and gemma.embed_scale == 64**0.5
    # The older sliding_window_pattern: every 6th layer global.
    config = tiny_config("gemma3", num_hidden_layers=7, layer_types=None, sliding_window_pattern=6)
    assert LlamaArch.from_config(config).layer_windows == (window,) * 5 + (None, window)


def test_a_multimodal_gemma3_folder_runs_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder: its text model, read from the language_model
    prefix, matches transformers' multimodal model on text."""
    folder = make_tiny_gemma3_multimodal(tmp_path / "gemma3")
    runner = ModelRunner(folder, num_blocks=16, block_size=4)
    assert runner.model.arch.model_type == "gemma3_text"
    assert runner.files.config.num_layers == 3 and runner.files.config.head_dim == 16
    hf = load_reference(folder)
    ids = [(7 * i + 3) % 150 for i in range(23)]
    table = list(range(6))
    first = runner.forward([SequenceInput(ids[:13], 0, table)])
    rest = runner.forward([SequenceInput(ids[13:], 13, table)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(first.logits[0], want[12], atol=2e-4, rtol=0)
    torch.testing.assert_close(rest.logits[0], want[-1], atol=2e-4, rtol=0)


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "soft-capping"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
        ("gemma3", {"hidden_activation": "relu"}, "activation 'relu'"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_configs_no_kernel_runs_are_refused(kind, overrides, message):
    config = tiny_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=message):
        LlamaArch.from_config(config)
