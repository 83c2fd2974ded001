"""Program semantics on a model-free backend: text, gen defaults, roles, forks, joins, scopes,
errors, streaming, async programs, nested calls and run_batch."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_backend import FakeBackend

import radixlang as sgl
from radixlang.lang.interpreter import ProgramError


@pytest.fixture
def backend():
    return FakeBackend()


def test_gen_sees_the_text_so_far_and_run_defaults_fill_unset_fields(backend):
    @sgl.function
    def prog(s, q):
        s += "Q: " + q + "\nA:"
        s += sgl.gen("a", max_tokens=3, stop="\n")
        s += "\nMore:"
        s += sgl.gen("b")

    state = prog.run(q="hi", backend=backend, max_new_tokens=7, temperature=0.5)
    (_, p1, s1), (_, p2, s2) = backend.calls
    assert p1 == "Q: hi\nA:"
    assert p2 == "Q: hi\nA:<1>\nMore:"
    assert s1["max_new_tokens"] == 3 and s2["max_new_tokens"] == 7
    assert s1["temperature"] == s2["temperature"] == 0.5
    assert s1["stop"] == ["\n", "<|im_end|>"]  # the template's end of turn is always a stop
    assert state["a"] == "<1>" and state["b"] == "<2>"
    assert state.text() == "Q: hi\nA:<1>\nMore:<2>"
    assert state.get_meta_info("a")["prompt_tokens"] == len(p1)


def test_an_unset_max_tokens_is_not_sent(backend):
    # The backend's default applies, which an engine cuts to what the context window has left;
    # a max_tokens given must fit.
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a") + sgl.gen("b", max_tokens=5)

    prog.run(backend=backend)
    (_, _, unset), (_, _, given) = backend.calls
    assert "max_new_tokens" not in unset and given["max_new_tokens"] == 5


def test_roles_in_both_forms_give_the_same_text_and_messages(backend):
    @sgl.function
    def expr_form(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("r1"))
        s += sgl.user_begin() + "Again" + sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("r2") + sgl.assistant_end()

    @sgl.function
    def block_form(s):
        with s.system():
            s += "Be brief."
        with s.user():
            s += "Hello"
        with s.assistant():
            s += sgl.gen("r1")
        s.user("Again")
        s.assistant(sgl.gen("r2"))

    a = expr_form.run(backend=FakeBackend())
    b = block_form.run(backend=FakeBackend())
    assert a.text() == b.text()
    assert (
        a.messages()
        == b.messages()
        == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "<1>"},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "<2>"},
        ]
    )
    assert a.text().count("<|im_end|>") == 5
    assert a.text().endswith("<|im_start|>assistant\n<2><|im_end|>\n")


def test_a_chat_without_system_gets_the_templates_default(backend):
    @sgl.function
    def prog(s):
        s += sgl.user("Hi")

    state = prog.run(backend=backend)
    assert state.messages()[0] == {"role": "system", "content": "You are helpful."}
    assert state.text().startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")


def test_nested_roles_raise_from_run(backend):
    @sgl.function
    def prog(s):
        s += sgl.user_begin()
        s += sgl.assistant("x")

    with pytest.raises(ProgramError, match="roles do not nest"):
        prog.run(backend=backend)


def test_fork_caches_the_prefix_once_and_join_gathers_lists_in_order(backend):
    @sgl.function
    def prog(s):
        s += "Shared prefix."
        forks = s.fork(3)
        forks += lambda i: f" Branch {i}:" + sgl.gen("x")
        forks.join()
        s += " Done."

    state = prog.run(backend=backend)
    assert backend.cached == ["Shared prefix."]
    prompts = sorted(p for _, p, _ in backend.calls)
    assert prompts == [f"Shared prefix. Branch {i}:" for i in range(3)]
    values = state["x"]
    assert isinstance(values, list) and len(values) == 3
    assert sorted(values) == ["<1>", "<2>", "<3>"]
    assert state.text() == "Shared prefix. Done."
    assert len(state.get_meta_info("x")) == 3


def test_forked_branches_run_concurrently():
    import threading

    barrier = threading.Barrier(4, timeout=10)

    def reply(prompt, sampling):
        barrier.wait()  # deadlocks (times out) unless all 4 branches call at once
        return "ok"

    @sgl.function
    def prog(s):
        s += "P"
        forks = s.fork(4)
        for i in range(4):
            forks[i] += sgl.gen("y")
        forks.join()

    state = prog.run(backend=FakeBackend(reply=reply))
    assert state["y"] == ["ok"] * 4


def test_concate_and_append_join(backend):
    @sgl.function
    def prog(s):
        s += "Tips:"
        forks = s.fork(2)
        forks += lambda i: f"\n{i + 1}. " + sgl.gen("tip")
        forks.join(mode="concate_and_append")
        s += "\nEnd"

    state = prog.run(backend=backend)
    text = state.text()
    assert text.startswith("Tips:\n1. <") and "\n2. <" in text and text.endswith("\nEnd")


def test_var_scope_holds_exactly_the_text_inside(backend):
    @sgl.function
    def prog(s):
        s += "before "
        with s.var_scope("inner"):
            s += "x = " + sgl.gen("v")
        s += " after"

    state = prog.run(backend=backend)
    assert state["inner"] == "x = <1>"


def test_value_read_mid_program_feeds_later_text(backend):
    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("a")
        answer = s["a"]
        s += f" You said {answer}."

    assert prog.run(backend=backend).text() == "A:<1> You said <1>."


def test_backend_error_reaches_run_with_its_type_and_stops_the_state(backend):
    backend.fail_on = "boom"

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("a")
        s += sgl.gen("b")

    with pytest.raises(ValueError, match="backend failure"):
        prog.run(backend=backend)
    assert len(backend.calls) == 1  # nothing after the failure ran


def test_reading_a_failed_variable_raises_inside_the_program(backend):
    backend.fail_on = "boom"
    seen = []

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("a")
        try:
            s["a"]
        except ValueError as e:
            seen.append(e)
            raise

    with pytest.raises(ValueError):
        prog.run(backend=backend)
    assert len(seen) == 1


def test_program_exception_reaches_run(backend):
    @sgl.function
    def prog(s):
        s += "x"
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        prog.run(backend=backend)


class HandOverBackend(FakeBackend):
    """Streams its reply a character at a time, each one only once the reader has taken the
    one before (``took``): each character is then a piece of its own, however the threads are
    scheduled. A reader that takes nothing for 30 s ends the hand-over (the rest streams at
    once), so a stream that does not reach the reader fails a test rather than hangs it."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply=lambda p, s: reply)
        self.took = threading.Event()

    def generate_stream(self, prompt, sampling):  # type: ignore[no-untyped-def]
        text, meta = self.generate(prompt, sampling)
        handing_over = True
        for i, ch in enumerate(text):
            if i and handing_over:
                handing_over = self.took.wait(30)
                self.took.clear()  # before the next character: the reader's next take sets it
            yield ch, {}
        yield "", meta


def test_streaming_text_iter_pieces_join_to_the_variable():
    backend = HandOverBackend("streamed words here")

    @sgl.function
    def prog(s):
        s += "Go:"
        s += sgl.gen("out")

    state = prog.run(backend=backend, stream=True)
    pieces = []
    for piece in state.text_iter("out"):
        pieces.append(piece)
        backend.took.set()
    assert pieces == list("streamed words here")  # each as it came, not all at the end
    assert "".join(pieces) == state["out"] == "streamed words here"
    assert "".join(state.text_iter()) == "Go:streamed words here"


def test_async_program_awaits_values_without_blocking_the_loop(backend):
    @sgl.function
    async def prog(s, q):
        s += q + sgl.gen("a")
        a = await s.aget("a")
        s += f" then {a}"
        await s

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        state = await prog.run_async("Q", backend=backend)
        task.cancel()
        return state, ticks

    state, ticks = asyncio.run(main())
    assert state.text() == "Q<1> then <1>"
    assert ticks > 0
    assert prog.run("Q", backend=FakeBackend()).text() == "Q<1> then <1>"  # sync run too


def test_nested_program_call_runs_on_the_same_state(backend):
    @sgl.function
    def inner(s, topic):
        s += f"About {topic}: " + sgl.gen("fact")

    @sgl.function
    def outer(s):
        s += "Start. "
        inner(s, "cats")
        s += " Then: " + s["fact"]

    state = outer.run(backend=backend)
    assert state.text() == "Start. About cats: <1> Then: <1>"


def test_bind_and_argument_errors(backend):
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    assert prog.bind(b="X").run(a="1", backend=backend).text() == "1X"
    with pytest.raises(TypeError, match="prog"):
        prog.run(backend=backend)  # missing a
    with pytest.raises(TypeError, match="no arguments"):
        prog.bind(zzz=1)


def test_run_batch_precaches_the_shared_prefix_and_keeps_order(backend, capsys):
    @sgl.function
    def prog(s, question):
        s += sgl.system("Few-shot examples: 1+1=2. 2+2=4.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer"))

    items = [{"question": f"What is {i}+{i}?"} for i in range(6)]
    states = prog.run_batch(items, backend=backend, progress_bar=True)
    assert [s.messages()[1]["content"] for s in states] == [it["question"] for it in items]
    assert len(backend.cached) == 1
    prefix = backend.cached[0]
    assert prefix.startswith("<|im_start|>system\nFew-shot examples")
    assert prefix.endswith("<|im_start|>user\nWhat is")
    assert all(p.startswith(prefix) for _, p, _ in backend.calls)
    assert "prog" in capsys.readouterr().err  # the progress bar


def test_run_batch_accepts_positional_items_and_raises_a_failed_item(backend):
    @sgl.function
    def prog(s, x):
        s += x + sgl.gen("y")

    assert len(prog.run_batch([["a"], ["b"]], backend=backend)) == 2
    backend.fail_on = "bad"
    with pytest.raises(ValueError):
        prog.run_batch([{"x": "ok"}, {"x": "bad"}], backend=backend)


def test_gen_with_n_returns_a_list(backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("v", n=3)

    state = prog.run(backend=backend)
    assert sorted(state["v"]) == ["<1>", "<2>", "<3>"]


def test_bad_arguments_fail_where_the_program_names_them():
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="bad regex"):
        sgl.gen("x", regex="(")
    with pytest.raises(TypeError, match="None"):
        sgl.gen("x") + None
    with pytest.raises(ValueError, match="fork size"):
        sgl.ProgramState.fork(None, 0)  # type: ignore[arg-type]


def test_select_uses_the_method_and_records_meta_info(backend):
    @sgl.function
    def prog(s):
        s += "Pick:"
        s += sgl.select("c", choices=["a", "bbb", "cc"])
        s += sgl.gen("after", choices=["x", "yy"])  # gen(choices=...) is a select

    state = prog.run(backend=backend)
    assert state["c"] == "bbb" and state["after"] == "yy"
    assert state.get_meta_info("c")["normalized_prompt_logprobs"] == [1.0, 3.0, 2.0]
    assert state.text() == "Pick:bbbyy"


def test_no_backend_is_a_clear_error():
    sgl.set_default_backend(None)

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()


def test_run_waits_for_branches_that_are_never_joined():
    import threading

    release = threading.Event()

    def reply(prompt, sampling):
        release.wait(5)
        return "late"

    backend = FakeBackend(reply=reply)

    @sgl.function
    def prog(s):
        s += "P"
        for f in s.fork(3):
            f += sgl.gen("x")  # never joined
        threading.Timer(0.2, release.set).start()

    prog.run(backend=backend)
    assert len(backend.calls) == 3 and release.is_set()


def test_an_error_in_an_unjoined_branch_reaches_run(backend):
    backend.fail_on = "bad"

    @sgl.function
    def prog(s):
        s += "P"
        forks = s.fork(2)
        forks += lambda i: ("bad" if i else "ok") + sgl.gen("x")

    with pytest.raises(ValueError, match="backend failure"):
        prog.run(backend=backend)


def test_a_program_argument_named_like_a_sampling_keyword_goes_to_the_program(backend):
    @sgl.function
    def prog(s, temperature, n):
        s += f"T={temperature} n={n}" + sgl.gen("x")

    state = prog.run(temperature="hot", n=3, backend=backend)
    assert state.text().startswith("T=hot n=3")
    assert backend.calls[0][2]["temperature"] == 1.0  # the run's default, untouched


def test_fork_returns_at_once_and_branches_start_from_the_fork_point():
    import threading

    release = threading.Event()
    forked = threading.Event()

    def reply(prompt, sampling):
        if prompt == "Q:":
            release.wait(5)  # the parent's gen is still running when fork() returns
            return "parent"
        return "child"

    backend = FakeBackend(reply=reply)

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a")
        forks = s.fork(2)
        forked.set()
        assert not release.is_set()
        forks += lambda i: f" b{i}:" + sgl.gen("b")
        release.set()
        forks.join()

    state = prog.run(backend=backend)
    assert forked.is_set()
    prompts = sorted(p for _, p, _ in backend.calls)
    assert prompts == ["Q:", "Q:parent b0:", "Q:parent b1:"]
    assert state["a"] == "parent"  # inherited, not gathered
    assert state["b"] == ["child", "child"]
    assert backend.cached == ["Q:parent"]


def test_a_parent_failing_before_the_fork_point_fails_its_branches(backend):
    backend.fail_on = "boom"

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("a")
        forks = s.fork(2)
        inner = forks[0].fork(2)  # a fork of a branch that never starts
        inner += lambda i: sgl.gen("deep")
        forks += lambda i: sgl.gen("b")
        forks.join()

    with pytest.raises(ValueError, match="backend failure"):
        prog.run(backend=backend)
    assert len(backend.calls) == 1


def test_forks_of_forks_build_a_tree(backend):
    @sgl.function
    def prog(s):
        s += "R"
        level1 = s.fork(2)
        level1 += lambda i: f"-{i}" + sgl.gen("x", max_tokens=1)
        leaves = []
        for branch in level1:
            level2 = branch.fork(2)
            level2 += lambda j: f"-{j}" + sgl.gen("y", max_tokens=1)
            leaves.extend(level2)
        s.ret = [leaf.text() for leaf in leaves]

    state = prog.run(backend=backend)
    texts = state.ret
    assert len(texts) == 4 and all(t.startswith("R-") for t in texts)
    assert {t[:3] for t in texts} == {"R-0", "R-1"}
    assert len(backend.calls) == 6
