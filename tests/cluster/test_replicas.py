"""Two replicas of the tiny chat model on a two-node Ray cluster (loopback), behind one server:
chats and forked programs from 16 clients give a single engine's greedy outputs, cache-aware
routing computes far fewer prompt tokens than round-robin, and a killed replica's requests are
retried or fail while the rest are served."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.ray

CLIENTS = 16
TURNS = 5
VOCABULARY = (
    "river stone maple cloud lantern harbor orbit velvet copper meadow signal ember quartz "
    "willow canyon pixel falcon tundra saffron glacier"
)
WORDS = VOCABULARY.split()
# The 16 clients' prompts need about 650 blocks of 16 tokens in all; a replica holds 400.
POOL_BLOCKS = 400
GREEDY = {"max_tokens": 8, "temperature": 0}


def document(i: int, words: int = 400) -> str:
    rng = random.Random(i)
    return f"Notes of client {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def replicas(ray_cluster, chat_model_dir):
    from radixlang.cluster.replica_set import ReplicaSet

    # Each replica's pool holds its share of the clients' prefixes, not all of them: a
    # router that spreads a program over both replicas makes each hold it, and evict more.
    # Deterministic: their greedy outputs are compared with one engine's, batched otherwise.
    rs = ReplicaSet(str(chat_model_dir), 2, num_blocks=POOL_BLOCKS, deterministic=True)
    yield rs
    rs.shutdown()


@pytest.fixture(scope="module")
def endpoint(replicas):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(replicas, dashboard=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(chat_model_dir):
    """The same model on one engine in this process, served the same way."""
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    engine = Engine(str(chat_model_dir), kv_memory="64MiB", deterministic=True)
    with serve_in_thread(engine, dashboard=False) as srv:
        yield srv
    engine.shutdown(free_cache=True)


def chat(url: str, i: int) -> list[str]:
    """A multi-turn chat over the OpenAI client, its turns tied together by a routing key."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": document(i)}]
    replies = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Question {turn} about the notes?"})
        out = client.chat.completions.create(
            model=model, messages=messages, extra_headers={"X-Routing-Key": f"chat-{i}"}, **GREEDY
        )
        reply = out.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def forked(url: str, i: int) -> list[str]:
    """A program that forks three branches off a long prefix and joins them (SGLang's API)."""
    import radixlang as sgl

    @sgl.function
    def ideas(s, i):
        s += document(i) + "\nThree ideas follow.\n"
        branches = s.fork(3)
        for j, branch in enumerate(branches):
            branch += f"Idea {j}:" + sgl.gen("idea", max_tokens=8, temperature=0)
        s += "Best:" + sgl.gen("best", max_tokens=8, temperature=0)
        return [b["idea"] for b in branches]

    backend = sgl.RuntimeEndpoint(url)
    state = ideas.run(i=i, backend=backend)
    return [*state.ret_value, state["best"]]


def traffic(url: str) -> list[list[str]]:
    """Half the clients chat, half run forked programs, all at once."""
    with ThreadPoolExecutor(CLIENTS) as pool:
        calls = [pool.submit(chat if i % 2 else forked, url, i) for i in range(CLIENTS)]
        return [c.result(timeout=300) for c in calls]


def computed_prompt_tokens(replicas, url: str, policy: str) -> tuple[int, list[list[str]]]:
    replicas.router.policy = policy
    try:
        replicas.flush_cache(10)
        replicas.reset_stats()
        outputs = traffic(url)
        stats = replicas.stats()
        print(policy, {k: stats[k] for k in ("prompt_tokens", "prompt_tokens_computed",
                                             "evicted_blocks", "retractions")})  # fmt: skip
        return int(stats["prompt_tokens_computed"]), outputs
    finally:
        replicas.router.policy = "cache_aware"


def test_one_replica_per_node_behind_one_endpoint(replicas, endpoint):
    assert len({info["node_id"] for info in replicas.replica_info}) == 2, "replicas share a node"
    assert replicas.cpus_per_replica == 1 and {i["threads"] for i in replicas.replica_info} == {1}
    with httpx.Client(base_url=endpoint.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200
        info = client.get("/get_server_info").json()
        assert info["stats"]["replicas"] == 2 and info["stats"]["replicas_up"] == 2
        sampling = {"max_new_tokens": 4, "temperature": 0}
        body = {"text": "Hello", "sampling_params": sampling, "routing_key": "k"}
        out = client.post("/generate", json=body)
        assert out.status_code == 200, out.text
        bad = client.post("/generate", json={"text": "x" * 10, "sampling_params": {
            "max_new_tokens": 4, "temperature": -1}})  # fmt: skip
        assert bad.status_code == 400 and "temperature" in bad.text  # a replica's refusal
        long_key = client.post(
            "/generate", json={"text": "Hi"}, headers={"X-Routing-Key": "k" * 300}
        )
        assert long_key.status_code == 400
        metrics = client.get("/metrics").text
    assert "radixlang_requests_finished_total" in metrics
    assert "radixlang_replicas_up 2" in metrics
    assert 'radixlang_routed_requests_total{reason="key"}' in metrics


def test_release_program_reaches_the_replica_that_retains_the_program(replicas, endpoint):
    def retained() -> int:
        return int(replicas.stats()["retained_paths"])

    before = retained()
    with httpx.Client(base_url=endpoint.url, timeout=60) as client:
        for i in range(2):  # one key: one replica; a path each
            body = {"text": f"Agent step {i}", "sampling_params": {"max_new_tokens": 2},
                    "routing_key": "agent-r", "retain_s": 3600}  # fmt: skip
            assert client.post("/generate", json=body).status_code == 200
        assert retained() == before + 2
        out = client.post("/release_program", json={"routing_key": "agent-r"})
        assert out.status_code == 200 and out.json()["released"] == 2, out.text
    assert retained() == before


@pytest.mark.compares_outputs
def test_chats_and_forks_match_one_engine_and_cache_aware_routing_computes_less(
    replicas, endpoint, reference
):
    aware, aware_out = computed_prompt_tokens(replicas, endpoint.url, "cache_aware")
    decisions = dict(replicas.router.decisions)
    in_turn, in_turn_out = computed_prompt_tokens(replicas, endpoint.url, "round_robin")
    single = traffic(reference.url)
    assert aware_out == single, "greedy outputs behind cache-aware routing differ from one engine"
    assert in_turn_out == single, "greedy outputs behind round-robin differ from one engine"
    print(f"prompt tokens computed: cache-aware {aware}, round-robin {in_turn} "
          f"({aware / in_turn:.2f}x); decisions {decisions}")  # fmt: skip
    assert aware <= 0.6 * in_turn
    assert decisions.get("prefix", 0) + decisions.get("key", 0) > decisions.get("load", 0)


def test_a_killed_replica_fails_or_retries_its_requests_and_the_rest_are_served(replicas):
    from radixlang.runtime.request import FinishReason

    long = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    short = {"max_new_tokens": 6, "temperature": 0}
    streaming = [replicas.submit(f"Story {i}: once upon a time", long) for i in range(4)]
    deadline = time.monotonic() + 60
    while not all(h._events for h in streaming) and time.monotonic() < deadline:
        time.sleep(0.01)
    placed = {h.request_id: replicas._flights[h.request_id].replica for h in streaming}
    assert set(placed.values()) == {0, 1}, "distinct prompts are spread by load"
    # Replica 1 stops producing: what it takes from now on streams nothing before it dies.
    replicas._actors[1].stall.remote(60)
    time.sleep(0.2)
    waiting = [replicas.submit(f"Question {i}: why is the sky", short) for i in range(6)]
    # A request no longer in flight has finished: on replica 0 (replica 1 finishes nothing now).
    flights = [replicas._flights.get(h.request_id) for h in waiting]
    moved = [f for f in flights if f is not None and f.replica == 1]
    assert moved, "some of the new requests went to replica 1"
    replicas.kill_replica(1)
    for h in streaming:
        result = h.result(timeout=120, raise_on_error=False)
        if placed[h.request_id] == 1:
            assert result.finish_reason is FinishReason.ERROR
            assert "replica 1 failed" in result.error
        else:
            assert result.finish_reason is FinishReason.LENGTH and result.completion_tokens == 900
    for h in waiting:
        assert h.result(timeout=120).finish_reason is not FinishReason.ERROR
    assert replicas.retried_requests >= len(moved)
    # Ray restarts it; it rejoins the rotation with an empty cache.
    deadline = time.monotonic() + 120
    while not replicas.router.healthy[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert replicas.router.healthy[1], "the restarted replica did not come back"
    handles = [replicas.submit(f"After {i}: hello", short) for i in range(4)]
    assert all(h.result(timeout=60).finish_reason is not FinishReason.ERROR for h in handles)
    replicas.flush_cache(30)
    replicas.check_integrity()
    stats = replicas.replica_stats()
    assert all(s["blocks_free"] == s["blocks_total"] for s in stats), "a KV block leaked"
    threading.enumerate()  # (the pollers stay up for the module's shutdown)
