"""200 requests from 50 concurrent loopback clients, 10% of them leaving mid-stream: every
completed greedy response equals the same request run alone, and once idle every block is free
or cached."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from server_checks import assert_no_leak, metrics

ABORTED = 'radixlang_requests_finished_by_reason_total{reason="abort"}'
SYSTEMS = ["You answer in one line.", "You are a poet.", "You list facts."]
QUESTIONS = ["Why is the sea salty?", "Name a prime.", "What is rust?", "Describe a cat.",
             "How far is the moon?", "Sing.", "What is 2+2?", "Who wrote Hamlet?"]  # fmt: skip


def _specs() -> list[tuple[str, str, dict]]:
    """40 distinct greedy requests over four routes, sharing system prompts (cache hits)."""
    specs = []
    for i in range(40):
        system, question = SYSTEMS[i % 3], QUESTIONS[i % 8]
        tokens = 4 + (i * 7) % 20
        kind = ("native", "native_stream", "completion", "chat_stream")[i % 4]
        if kind.startswith("native"):
            body = {"text": f"{system}\n{question} ({i})", "stream": kind == "native_stream",
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}  # fmt: skip
            specs.append(("/generate", kind, body))
        elif kind == "completion":
            body = {"model": "default", "prompt": f"{system}\n{question} ({i})",
                    "max_tokens": tokens, "temperature": 0}  # fmt: skip
            specs.append(("/v1/completions", kind, body))
        else:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"{question} ({i})"}]  # fmt: skip
            body = {"model": "default", "messages": messages, "max_tokens": tokens,
                    "temperature": 0, "stream": True}  # fmt: skip
            specs.append(("/v1/chat/completions", kind, body))
    return specs


async def _run(client: httpx.AsyncClient, route: str, kind: str, body: dict) -> str:
    """The response's text, read the way each route gives it."""
    if not body.get("stream"):
        response = await client.post(route, json=body)
        response.raise_for_status()
        data = response.json()
        return data["text"] if kind == "native" else data["choices"][0]["text"]
    text = ""
    async with client.stream("POST", route, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if kind == "native_stream":
                text = chunk["text"]  # cumulative
            else:
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text


async def _leave_mid_stream(client: httpx.AsyncClient, i: int) -> None:
    body = {"text": f"A long story, number {i}:", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    async with client.stream("POST", "/generate", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                return  # closing the stream here drops the connection mid-response


async def _storm(url: str, jobs: list, clients: int) -> dict[int, str]:
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    texts: dict[int, str] = {}

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while not queue.empty():
                n, spec = queue.get_nowait()
                if spec is None:
                    await _leave_mid_stream(client, n)
                else:
                    texts[n] = await _run(client, *spec)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return texts


def test_200_requests_from_50_clients_with_10_percent_leaving(server, client, engine):
    specs = _specs()
    alone = [asyncio.run(_alone(server.url, spec)) for spec in specs]  # one at a time
    jobs = [(n, specs[n % 40]) for n in range(180)] + [(n, None) for n in range(180, 200)]
    random.Random(0).shuffle(jobs)
    aborted_before = metrics(client)[ABORTED]
    texts = asyncio.run(_storm(server.url, jobs, clients=50))
    assert len(texts) == 180
    mismatches = [n for n, text in texts.items() if text != alone[n % 40]]
    assert not mismatches, [(n, texts[n], alone[n % 40]) for n in mismatches[:3]]
    assert_no_leak(client)
    m = metrics(client)
    assert m[ABORTED] - aborted_before == 20  # every client that left was aborted
    engine.check_integrity()


async def _alone(url: str, spec: tuple[str, str, dict]) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await _run(client, *spec)
