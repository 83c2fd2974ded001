"""The language's API surface: ``gen``'s SGLang signature with ``repetition_penalty`` and
``skip_special_tokens`` carried to the backends, ``Runtime(model=...)`` and its ``model_path``
alias, the ``sum_of_logprobs`` select method and ``ChoicesSamplingMethod`` exported, the local
runtime's ``flush_cache``/``reset_stats``, and ``join`` warning of forks' variables it drops."""

from __future__ import annotations

import inspect
import json
import re
import warnings

import httpx
import pytest
from fake_backend import FakeBackend

import radixlang as sgl
from radixlang.lang.backends.openai import OpenAI
from radixlang.lang.choices import decide, token_length_normalized
from radixlang.runtime import CacheBusyError

# SGLang 0.5.23's gen(), in its order (sglang/lang/api.py): positional calls bind the same.
SGLANG_GEN = [
    "name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex",
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "ignore_eos", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "dtype", "choices", "choices_method", "regex", "json_schema",
]  # fmt: skip
IM_END = 2  # the tiny chat model's (the default model's) <|im_end|>, a special token


# ---- gen -----------------------------------------------------------------------------------
def test_gen_takes_sglangs_arguments_in_sglangs_order_then_its_own():
    names = list(inspect.signature(sgl.gen).parameters)
    assert names[: len(SGLANG_GEN)] == SGLANG_GEN
    assert {"repetition_penalty", "skip_special_tokens", "seed"} <= set(names)


def test_repetition_penalty_and_skip_special_tokens_reach_the_backend():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "A" + sgl.gen("a", repetition_penalty=1.3, skip_special_tokens=False)
        s += "B" + sgl.gen("b")

    prog.run(backend=backend)
    (_, _, a), (_, _, b) = backend.calls
    assert (a["repetition_penalty"], a["skip_special_tokens"]) == (1.3, False)
    assert "repetition_penalty" not in b and "skip_special_tokens" not in b  # backend defaults
    prog.run(backend=backend, repetition_penalty=1.1, skip_special_tokens=True)  # run defaults
    (_, _, a), (_, _, b) = backend.calls[2:]
    assert (a["repetition_penalty"], a["skip_special_tokens"]) == (1.3, False)
    assert (b["repetition_penalty"], b["skip_special_tokens"]) == (1.1, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": -1.5}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty must be a finite number > 0"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False"),
        ({"skip_special_tokens": 0}, "skip_special_tokens must be True or False"),
    ],
)
def test_bad_penalty_or_special_tokens_fail_where_gen_is_called(kwargs, message):
    with pytest.raises(ValueError, match=rf"gen\('x'\): {message}"):
        sgl.gen("x", **kwargs)


def test_the_local_runtime_honours_both(tiny_runtime):
    """Special tokens stay in the text only when asked; the penalty reaches the engine."""
    forced = {"max_new_tokens": 2, "logit_bias": {IM_END: 100.0}, "ignore_eos": True}
    kept, meta = tiny_runtime.generate("Hi", forced | {"skip_special_tokens": False})
    dropped, meta_dropped = tiny_runtime.generate("Hi", forced)
    assert meta["output_ids"] == meta_dropped["output_ids"] == [IM_END, IM_END]
    assert kept == "<|im_end|><|im_end|>" and dropped == ""

    submitted = []
    submit = tiny_runtime.engine.submit

    def spy(request):
        submitted.append(request.sampling)
        return submit(request)

    tiny_runtime.engine.submit = spy
    try:

        @sgl.function
        def prog(s):
            s += "Hi" + sgl.gen("a", max_tokens=2, repetition_penalty=1.5)

        prog.run(backend=tiny_runtime)
    finally:
        del tiny_runtime.engine.submit
    assert submitted[-1]["repetition_penalty"] == 1.5


def _service(requests: list[dict]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        choice = {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}
        return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": {}})

    return httpx.MockTransport(handle)


def test_openai_sends_them_to_compatible_services_and_refuses_them_on_openai():
    @sgl.function
    def prog(s, extra):
        s += "A" + sgl.gen("a", max_tokens=2, **extra)

    sent: list[dict] = []
    compatible = OpenAI("m", base_url="http://vllm/v1", api_key="k", is_chat_model=False,
                        transport=_service(sent))  # fmt: skip
    prog.run(extra={"repetition_penalty": 1.2, "skip_special_tokens": False}, backend=compatible)
    assert (sent[0]["repetition_penalty"], sent[0]["skip_special_tokens"]) == (1.2, False)

    official = OpenAI("m", api_key="k", is_chat_model=False, transport=_service(sent))
    for extra in ({"repetition_penalty": 1.2}, {"skip_special_tokens": False}):
        (name,) = extra
        with pytest.raises(NotImplementedError, match=f"OpenAI's API has no {name}"):
            prog.run(extra=extra, backend=official)
    prog.run(extra={"repetition_penalty": 1.0, "skip_special_tokens": True}, backend=official)
    assert len(sent) == 2 and "repetition_penalty" not in sent[1]  # defaults: nothing to send


# ---- Runtime(model=...) ----------------------------------------------------------------------
def test_runtime_names_the_model_as_the_engine_does(chat_model_dir):
    assert "model" in inspect.signature(sgl.Runtime).parameters
    with pytest.raises(TypeError, match="both model and model_path"):
        sgl.Runtime(chat_model_dir, model_path=chat_model_dir)
    for runtime in (
        sgl.Runtime(model=chat_model_dir, num_blocks=16),
        sgl.Runtime(model_path=str(chat_model_dir), num_blocks=16),  # SGLang's name
    ):
        try:
            assert runtime.engine.files.path == chat_model_dir
            assert runtime.engine.dtype in ("float32", "bfloat16")  # "auto", resolved
        finally:
            runtime.shutdown()


def test_runtime_flush_cache_and_reset_stats(tiny_runtime):
    engine = tiny_runtime.engine
    handle = engine.submit([5, 6, 7], {"max_new_tokens": 200, "ignore_eos": True})
    try:
        with pytest.raises(CacheBusyError, match="requests are in flight"):
            tiny_runtime.flush_cache()
    finally:
        handle.abort()
    assert tiny_runtime.flush_cache(wait=30) is True
    assert sgl.flush_cache(tiny_runtime) is True
    tiny_runtime.generate("Hello", {"max_new_tokens": 2, "ignore_eos": True})
    tiny_runtime.reset_stats()
    assert tiny_runtime.stats()["generated_tokens"] == 0
    assert tiny_runtime.stats()["cached_tokens"] > 0


# ---- select: sum_of_logprobs ---------------------------------------------------------------
# "yes" is one unlikely token; "of course" two, the first likely and the second less so: by
# mean log-probability "of course" wins (-1.75 > -2.0), by total "yes" does (-2.0 > -3.5).
CHOICES = ["yes", "of course"]
SCORED = [[(-2.0, 1, "yes")], [(-0.5, 2, "of"), (-3.0, 3, " course")]]


def test_sum_of_logprobs_picks_the_highest_total_where_the_mean_disagrees():
    by_sum = decide(CHOICES, SCORED, sgl.sum_of_logprobs, 0.0, start=4)
    by_mean = decide(CHOICES, SCORED, token_length_normalized, 0.0, start=4)
    assert (by_sum.decision, by_mean.decision) == ("yes", "of course")
    assert by_sum.meta_info["sum_prompt_logprobs"] == [-2.0, -3.5]
    assert by_sum.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.75]
    assert by_sum.meta_info["scored_from_position"] == 4


def test_sampled_select_samples_by_the_methods_own_scores():
    # Near-zero temperature: sampling takes the best by whatever it samples by.
    assert {decide(CHOICES, SCORED, sgl.sum_of_logprobs, 1e-3, 4).decision for _ in range(20)} == {
        "yes"
    }
    assert {
        decide(CHOICES, SCORED, token_length_normalized, 1e-3, 4).decision for _ in range(20)
    } == {"of course"}


def test_sum_of_logprobs_on_the_local_runtime(tiny_runtime):
    @sgl.function
    def pick(s, method):
        s += "The best answer is " + sgl.select(
            "a", ["no", "not at all, never"], choices_method=method
        )

    for method in (sgl.sum_of_logprobs, sgl.token_length_normalized):
        state = pick.run(method=method, backend=tiny_runtime)
        meta = state.get_meta_info("a")
        rows = meta["input_token_logprobs"]
        sums = [sum(lp for lp, _, _ in row) for row in rows]
        means = [total / len(row) for total, row in zip(sums, rows, strict=True)]
        scores = sums if method is sgl.sum_of_logprobs else means
        assert state["a"] == ["no", "not at all, never"][scores.index(max(scores))]
        assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
    assert meta["input_token_logprobs"][1][-1][0] < 0  # every choice token is scored


def test_a_method_of_ones_own_subclasses_the_exported_base():
    class Shortest(sgl.ChoicesSamplingMethod):
        def __call__(self, *, choices, **scores):
            return sgl.ChoicesDecision(min(choices, key=len), {"why": "shortest"})

    @sgl.function
    def prog(s):
        s += "Say " + sgl.select(
            "a", ["a long one", "short", "medium one"], choices_method=Shortest()
        )

    state = prog.run(backend=FakeBackend())
    assert state["a"] == "short" and state.get_meta_info("a") == {"why": "shortest"}
    assert {"ChoicesSamplingMethod", "ChoicesDecision", "sum_of_logprobs"} <= set(sgl.__all__)


# ---- join ----------------------------------------------------------------------------------
def _join_warnings(program, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = program.run(backend=FakeBackend(), **kwargs)
    return state, [w for w in caught if issubclass(w.category, UserWarning)]


def test_join_warns_when_forks_remake_a_variable_the_parent_holds():
    @sgl.function
    def prog(s):
        s += "Q" + sgl.gen("answer")
        forks = s.fork(2)
        forks += lambda i: f"draft {i}: " + sgl.gen("answer") + sgl.gen("score")
        forks.join()

    state, caught = _join_warnings(prog)
    assert state["answer"] == "<1>"  # the parent's, as in SGLang
    assert len(state["score"]) == 2  # new variables are still gathered
    (warning,) = caught
    assert "variable 'answer'" in str(warning.message) and "score" not in str(warning.message)
    assert warning.filename == __file__  # it points at the program's forks.join()


def test_join_warns_for_a_variable_the_parent_made_after_the_fork_and_for_assignments():
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += sgl.gen("x")
        s += sgl.gen("x") + sgl.gen("y")
        for i, fork in enumerate(forks):
            fork["y"] = i  # s["y"] = ... in a fork, for a name the parent holds
        forks.join()

    state, caught = _join_warnings(prog)
    assert isinstance(state["x"], str) and isinstance(state["y"], str)  # never replaced
    named = [re.search(r"variable '(\w+)'", str(w.message)) for w in caught]
    assert sorted(m.group(1) for m in named if m) == ["x", "y"]


def test_join_is_quiet_when_forks_only_inherit_the_parents_variables():
    @sgl.function
    def prog(s):
        s += sgl.gen("topic")
        forks = s.fork(3)
        forks += lambda i: f"{i} " + sgl.gen("idea")
        forks.join()
        with s.copy() as c:
            c += sgl.gen("aside")

    state, caught = _join_warnings(prog)
    assert caught == []
    assert len(state["idea"]) == 3 and state["aside"] == [state["aside"][0]]
