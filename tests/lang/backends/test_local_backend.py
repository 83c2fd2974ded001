"""The local runtime under programs: select's scores against brute force, the token boundary
between prompt and choice, the chat template from the tokenizer, and the cache across forks."""

from __future__ import annotations

import pytest
import torch

import radixlang as sgl


@pytest.fixture(scope="module")
def hf_model(chat_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()


def _mean_logprob(model, ids: list[int], start: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return float(torch.stack([lps[t - 1, ids[t]] for t in range(start, len(ids))]).mean())


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
def test_select_scores_equal_brute_force(tiny_runtime, hf_model, method):
    @sgl.function
    def prog(s):
        s += "Question: is water wet?\nAnswer:"
        s += sgl.select("a", choices=[" yes", " no", " it depends on the context"],
                        choices_method=method)  # fmt: skip

    state = prog.run(backend=tiny_runtime)
    meta = state.get_meta_info("a")
    start = meta["scored_from_position"]
    tok = tiny_runtime.tokenizer
    for choice, score in zip(
        [" yes", " no", " it depends on the context"],
        meta["normalized_prompt_logprobs"],
        strict=True,
    ):
        ids = tok.encode("Question: is water wet?\nAnswer:" + choice)
        assert score == pytest.approx(_mean_logprob(hf_model, ids, start), abs=1e-4)
    assert state["a"] in (" yes", " no", " it depends on the context")
    assert state.text().endswith(state["a"])


def test_select_scores_every_choice_from_where_tokenizations_part(tiny_runtime):
    tok = tiny_runtime.tokenizer
    prompt = "The answer is "  # BPE joins the trailing space to the choice's first word
    prompt_ids = tok.encode(prompt)
    assert tok.encode(prompt + "yes")[: len(prompt_ids)] != prompt_ids

    @sgl.function
    def prog(s):
        s += prompt
        s += sgl.select("a", choices=["yes", "no"])

    meta = prog.run(backend=tiny_runtime).get_meta_info("a")
    start = meta["scored_from_position"]
    assert start == len(tok.encode(prompt.rstrip()))
    for choice, lps in zip(["yes", "no"], meta["input_token_logprobs"], strict=True):
        ids = tok.encode(prompt + choice)
        assert [t for _, t, _ in lps] == ids[start:]


def test_chat_template_comes_from_the_tokenizer(tiny_runtime):
    template = tiny_runtime.get_chat_template()
    assert template.prefix["user"] == "<|im_start|>user\n"
    assert template.suffix["assistant"] == "<|im_end|>\n"
    assert template.stop_str == ("<|im_end|>",)
    assert template.default_system_prompt.startswith("You are a helpful AI assistant")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert template.render(messages) == tiny_runtime.tokenizer.apply_chat_template(
        messages, tokenize=False
    )


def test_fork_computes_the_shared_prompt_once(tiny_runtime):
    assert tiny_runtime.flush_cache()
    shared = "A long shared question. " * 40

    @sgl.function
    def prog(s):
        s += sgl.user(shared)
        s += sgl.assistant_begin()
        forks = s.fork(8)
        forks += lambda i: sgl.gen("x", max_tokens=4, temperature=1.0, seed=i)
        forks.join()

    before = tiny_runtime.stats()
    state = prog.run(backend=tiny_runtime)
    after = tiny_runtime.stats()
    assert len(state["x"]) == 8
    prompt_len = len(tiny_runtime.tokenizer.encode(state.text()))
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert prompt_len <= computed < prompt_len + 8 * 2
    tiny_runtime.engine.check_integrity()


def test_streamed_gen_on_the_engine(tiny_runtime):
    @sgl.function
    def prog(s):
        s += "Count:"
        s += sgl.gen("n", max_tokens=12, temperature=0, ignore_eos=True)

    state = prog.run(backend=tiny_runtime, stream=True)
    pieces = list(state.text_iter("n"))
    assert "".join(pieces) == state["n"]
    assert state.get_meta_info("n")["completion_tokens"] == 12


def test_bad_input_in_a_program_fails_that_program_only(tiny_runtime):
    from radixlang.runtime.engine import RequestError

    @sgl.function
    def too_long(s):
        s += "word " * 2000  # beyond the tiny model's 1024-token context
        s += sgl.gen("x", max_tokens=4)

    @sgl.function
    def bad_param(s):
        s += "Hello"
        s += sgl.gen("x", max_tokens=-3)

    @sgl.function
    def fine(s):
        s += "Hello"
        forks = s.fork(3)
        forks += lambda i: sgl.gen("x", max_tokens=3)
        forks.join()

    with pytest.raises(RequestError, match="context window"):
        too_long.run(backend=tiny_runtime)
    with pytest.raises(RequestError, match="max_new_tokens"):
        bad_param.run(backend=tiny_runtime)
    assert len(fine.run(backend=tiny_runtime)["x"]) == 3
    engine = tiny_runtime.engine
    engine.check_integrity()
    assert tiny_runtime.flush_cache()
    stats = tiny_runtime.stats()
    assert stats["blocks_free"] == stats["blocks_total"]  # nothing leaked
