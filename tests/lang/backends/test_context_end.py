"""A program's gen at the end of the context window, in process and over HTTP: without
``max_tokens`` it gets the room that is left (the default, cut to fit); a ``max_tokens`` that
does not fit is refused where the gen is, with the numbers (as SGLang's and OpenAI's servers
refuse it)."""

from __future__ import annotations

import pytest

import radixlang as sgl
from radixlang.lang.backends.endpoint import EndpointError
from radixlang.runtime import RequestError

ROOM = 3  # tokens the prompt leaves in the context window


@pytest.fixture(params=["local", "endpoint"])
def backend(request, local, server):
    if request.param == "local":
        yield local
        return
    with sgl.RuntimeEndpoint(server.url) as endpoint:
        yield endpoint


def text_of(engine, tokens: int) -> str:
    """A text the engine reads as exactly ``tokens`` tokens."""
    text = "hi" + " hi" * (tokens - 1)
    assert len(engine.tokenizer.encode(text)) == tokens
    return text


def test_a_gen_without_max_tokens_gets_the_room_left(backend, engine):
    text = text_of(engine, engine.max_context - ROOM)

    @sgl.function
    def prog(s):
        s += text + sgl.gen("a", ignore_eos=True, temperature=0)

    state = prog.run(backend=backend)
    assert state.get_meta_info("a")["completion_tokens"] == ROOM


def test_a_max_tokens_that_does_not_fit_is_refused_with_the_numbers(backend, engine):
    window = engine.max_context
    text = text_of(engine, window - ROOM)

    @sgl.function
    def prog(s, max_tokens):
        s += text + sgl.gen("a", max_tokens=max_tokens, ignore_eos=True, temperature=0)

    with pytest.raises((RequestError, EndpointError)) as refused:
        prog.run(max_tokens=ROOM + 1, backend=backend)
    message = str(refused.value)
    for number in (f"max_new_tokens is {ROOM + 1}", f"{window - ROOM} tokens",
                   f"at most {ROOM}", f"window of {window}"):  # fmt: skip
        assert number in message, message
    state = prog.run(max_tokens=ROOM, backend=backend)  # one that just fits
    assert state.get_meta_info("a")["completion_tokens"] == ROOM
