"""One server, three kinds of client: a radixlang program through ``RuntimeEndpoint``, the
official ``openai`` client, and plain HTTP (SGLang's ``/generate``), all sharing one radix
cache.

Without ``--url`` it starts a server on the default model in this process (a free loopback
port); with ``--url`` it talks to one started with ``radixlang serve``. The program forks three
answers from one cached prompt; the ``openai`` client streams a chat reply; the plain request
reuses the program's prompt. It ends with the server's own cache figures from ``/metrics``.

    .venv/bin/python examples/serve_and_query.py [--url http://127.0.0.1:30000] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import contextlib

import httpx

import radixlang as sgl
from radixlang.server.metrics import parse

SYSTEM = "You are a friendly travel guide. Answer in one or two sentences."


@sgl.function
def ideas(s, city: str, max_tokens: int):
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Suggest one thing to do in {city}.")
    forks = s.fork(3)  # one prefill-only request caches the prompt; the branches then hit it
    forks += lambda i: sgl.assistant(
        sgl.gen("idea", max_tokens=max_tokens, temperature=0.8, seed=i)
    )
    forks.join()


@contextlib.contextmanager
def a_server(url: str | None):
    if url:
        yield url
        return
    from radixlang.runtime import Engine
    from radixlang.server import serve_in_thread

    engine = Engine(dtype="bfloat16")
    with serve_in_thread(engine) as server:
        print(f"serving {engine.files.name} at {server.url} (in this process)")
        yield server.url
    engine.shutdown(free_cache=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running radixlang (or SGLang) server; default: start one")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--city", default="Lisbon")
    args = parser.parse_args()

    with a_server(args.url) as url:
        # 1. A program, exactly as in process, over HTTP.
        with sgl.RuntimeEndpoint(url) as backend:
            state = ideas.run(city=args.city, max_tokens=args.max_tokens, backend=backend)
            template = backend.get_chat_template()  # read off the server's chat template
        print(f"\n== three ideas for {args.city} (a forked program over RuntimeEndpoint)")
        for i, idea in enumerate(state["idea"], 1):
            print(f"{i}. {idea.strip()}")

        # 2. The official openai client, streaming a chat reply.
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        print(f"\n== a streamed chat reply from {model} (the openai client)")
        stream = client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What should I eat in {args.city}?"},
            ],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
        print()

        # 3. Plain HTTP: SGLang's /generate over the program's prompt, which the cache holds.
        opening, _ = template.get_prefix_and_suffix("assistant", state.messages())
        prompt = state.text() + opening
        out = httpx.post(url + "/generate", timeout=120, json={
            "text": prompt, "sampling_params": {"max_new_tokens": args.max_tokens,
                                                "temperature": 0}})  # fmt: skip
        out.raise_for_status()
        meta = out.json()["meta_info"]
        print(f"\n== /generate over the program's prompt: {meta['cached_tokens']} of "
              f"{meta['prompt_tokens']} prompt tokens came from the cache")  # fmt: skip
        print(out.json()["text"].strip())

        m = parse(httpx.get(url + "/metrics").text)
        print(
            f"\nserver: {int(m['radixlang_requests_finished_total'])} requests, prompt tokens: "
            f"{int(m['radixlang_prompt_tokens_cached_total'])} reused, "
            f"{int(m['radixlang_prompt_tokens_computed_total'])} computed "
            f"(cache hit rate {m['radixlang_cache_hit_rate']:.1%}); "
            f"{int(m['radixlang_generated_tokens_total'])} tokens generated"
        )


if __name__ == "__main__":
    main()
