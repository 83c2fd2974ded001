"""The server on the default model: a program through ``RuntimeEndpoint`` gives what it gives
in process, and the official ``openai`` client chats with it."""

from __future__ import annotations

import openai
import pytest

import radixlang as sgl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    from radixlang.lang.backends.local import LocalBackend
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    # Deterministic, and a flushed cache for each run: greedy text then does not depend on
    # which prefix was cached or how the branches' requests were batched, in either dtype.
    engine = Engine(deterministic=True)
    with serve_in_thread(engine) as server:
        yield server, LocalBackend(engine)
    engine.shutdown(free_cache=True)


@sgl.function
def tips(s, topic):
    s += sgl.system("You are a concise assistant.")
    s += sgl.user(f"Give one tip about {topic}.")
    forks = s.fork(3)
    forks += lambda i: sgl.assistant(sgl.gen("draft", max_tokens=24, temperature=0))
    forks.join()
    drafts = "\n".join(f"{i + 1}. {d}" for i, d in enumerate(s["draft"]))
    s += sgl.assistant("Drafts:\n" + drafts)
    s += sgl.user("Which draft is best? Answer with its number.")
    s += sgl.assistant(sgl.select("best", choices=["1", "2", "3"]))


@pytest.mark.compares_outputs
def test_a_program_over_http_equals_the_program_in_process(served):
    server, local = served
    endpoint = sgl.RuntimeEndpoint(server.url)
    try:
        remote = tips.run(topic="sleep", backend=endpoint)
        assert local.flush_cache()
        here = tips.run(topic="sleep", backend=local)
    finally:
        endpoint.shutdown()
    assert remote["draft"] == here["draft"] and all(remote["draft"])
    assert remote["best"] == here["best"]
    assert remote.messages() == here.messages()


def test_the_openai_client_chats_with_the_default_model(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        # A question whose first answer token leads by a whole logit: "What is the capital of
        # France?" alone has two first tokens within rounding of each other in bfloat16, and
        # which one wins moved with an attention kernel's summation order.
        messages=[
            {
                "role": "user",
                "content": "What is the capital city of France? Answer in one sentence.",
            }
        ],
        max_tokens=24,
        temperature=0,
    )
    choice = out.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length") and out.usage.completion_tokens > 0
