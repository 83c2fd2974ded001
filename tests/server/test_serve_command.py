"""``radixlang serve`` as a process: it starts, serves, and on SIGINT drains the request in
flight, stops the engine and frees every KV block before it exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from engine_gate import hold_steps  # tests/, on the path through tests/conftest.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a server may take to come up or to go: a hang guard only. A local Ray and two
# replicas on two cores that other processes keep busy took over two minutes to come up.
START_S = 600


def _start(cmd: list[str], url: str) -> subprocess.Popen:
    """Run ``radixlang serve`` and wait until /health answers (killed if it does not)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.monotonic() + START_S
    try:
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # a clean stop takes its local Ray down with it
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        raise


def test_the_cache_dir_keeps_the_cache_across_a_sigterm_restart(chat_model_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixlang.cli", "serve", "--model", str(chat_model_dir),
           "--port", str(port), "--dtype", "float32", "--kv-memory", "16MiB",
           "--cache-dir", str(tmp_path), "--host-tier-memory", "8MiB"]  # fmt: skip
    shots = "".join(f"Q: what is {i} plus {i}? A: {2 * i}.\n" for i in range(12))
    body = {"text": shots + "Q: what is 7 plus 8? A:",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}  # fmt: skip
    outputs, errs = [], []
    for _ in range(2):
        proc = _start(cmd, url)
        try:
            r = httpx.post(url + "/generate", json=body, timeout=60).json()
            outputs.append((r["text"], r["meta_info"]["cached_tokens"]))
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            errs.append(err)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
    (before, cached_before), (after, cached_after) = outputs
    assert cached_before == 0 and cached_after > 100  # the few-shot prefix came from disk
    assert after == before
    assert "loaded the radix cache" in errs[1]

    # (A damaged or foreign file is refused with a message and the engine starts empty:
    # tests/runtime/test_engine_memory_tiers.py.)


def test_serve_drains_and_frees_every_block_on_sigint(chat_model_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "radixlang.cli", "serve", "--model", str(chat_model_dir),
           "--port", str(port), "--dtype", "float32", "--kv-memory", "32MiB",
           "--served-model-name", "tiny-chat", "--drain-timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny-chat"

        # A stream in flight when the signal comes: it is drained, not cut.
        body = {"text": "Keep going", "stream": True,
                "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}  # fmt: skip
        chunks: list[dict] = []
        started = threading.Event()

        def read_stream() -> None:
            with httpx.stream("POST", url + "/generate", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGINT)
        reader.join(60)
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "serving tiny-chat on" in out
    assert "every KV block is free" in err


def test_shutdown_past_the_drain_timeout_aborts_and_frees_every_block(chat_model_dir):
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import ServerThread

    engine = Engine(str(chat_model_dir), kv_memory="16MiB", dtype="float32")
    server = ServerThread(engine, owns_engine=True, drain_timeout=0.5)
    body = {"text": "Never ending", "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    outcome: list[object] = []

    def wait_for_it() -> None:
        try:
            outcome.append(httpx.post(server.url + "/generate", json=body, timeout=60))
        except httpx.HTTPError as e:
            outcome.append(e)

    # The request runs and is held after its first token: only the drain's timeout can end it.
    with hold_steps(engine, after_tokens=1) as gate:
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        gate.wait_holding()
        assert engine.stats()["running_requests"] == 1
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(60)  # a drain that waited for the request would wait here, held
        drained = not stopper.is_alive()
    stopper.join(60)  # (released: a drain that waited for the request ends now)
    assert drained, "the shutdown waited past the drain timeout"
    waiter.join(30)
    assert not engine.is_running
    assert engine.stats()["finished_abort"] == 1  # cut off at the drain timeout, not finished
    assert engine.pool.num_free == engine.pool.num_blocks  # the app's shutdown freed them all
    # The client saw its connection end or an error (uvicorn cancels what is left at the drain
    # timeout), never a hang and never a result it did not get.
    assert outcome and (isinstance(outcome[0], httpx.HTTPError) or outcome[0].status_code >= 500)


def test_overload_is_refused_with_503_and_cors_is_answered(chat_model_dir):
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    # One request runs at a time, so the others queue.
    engine = Engine(str(chat_model_dir), kv_memory="16MiB", max_running_requests=1)
    long = {"text": "Busy", "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    short = {"text": "Me too", "sampling_params": {"max_new_tokens": 1}}
    origin = "http://localhost:3000"
    try:
        with serve_in_thread(engine, max_queued_requests=2, allowed_origins=[origin]) as srv:
            # The first request runs and is held after its first token, the other two queue
            # behind it: the queue is full for as long as the test looks.
            with hold_steps(engine, after_tokens=1) as gate:
                handles = [engine.submit("x" * 5, long["sampling_params"]) for _ in range(3)]
                gate.wait_holding()
                deadline = time.monotonic() + 30
                while engine.num_waiting != 2:  # (the last ones may still be in its inbox)
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                refused = httpx.post(srv.url + "/generate", json=short, timeout=60)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "server_overloaded"
                assert engine.num_waiting == 2 and not any(h.done for h in handles)
                for h in handles:
                    h.abort()
            deadline = time.monotonic() + 30
            while engine.num_waiting:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert httpx.post(srv.url + "/generate", json=short, timeout=60).status_code == 200
            preflight = httpx.options(
                srv.url + "/v1/chat/completions",
                headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == origin
            other = httpx.get(srv.url + "/health", headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in other.headers
    finally:
        engine.shutdown(free_cache=True)


def _replicas_serve(model_dir, *flags: str, check) -> str:
    """``radixlang serve --replicas 2 FLAGS`` until ``check(url)`` has run, then SIGINT: it must
    exit 0. Returns what it printed."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixlang.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--kv-memory", "16MiB",
           "--replicas", "2", *flags]  # fmt: skip
    proc = _start(cmd, url)
    try:
        check(url)
        proc.send_signal(signal.SIGINT)
        printed, err = proc.communicate(timeout=START_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return printed


@pytest.mark.ray
def test_serve_with_two_replicas_on_a_local_ray(chat_model_dir):
    """``radixlang serve --replicas 2`` starts a local Ray (loopback), serves through both
    replicas and stops them on SIGINT."""
    pytest.importorskip("ray")

    def check(url: str) -> None:
        prompts = [f"Item {i}: a distinct opening line" for i in range(6)]
        body = {"text": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        out = httpx.post(url + "/generate", json=body, timeout=60)
        assert out.status_code == 200 and len(out.json()) == 6, out.text
        stats = httpx.get(url + "/get_server_info", timeout=30).json()["stats"]
        assert stats["replicas_up"] == 2 and stats["finished_requests"] >= 6
        assert httpx.get(url + "/dashboard", timeout=5).status_code == 404  # one engine's page

    printed = _replicas_serve(chat_model_dir, "--cpus-per-replica", "1", check=check)
    assert "2 replicas on a local Ray" in printed and "cache_aware routing" in printed


@pytest.mark.ray
def test_serve_joins_a_ray_cluster(ray_cluster, chat_model_dir):
    """``--ray-address`` puts the replicas on an existing cluster (the session's two nodes):
    one on each, and the cluster outlives the server."""
    import ray

    def check(url: str) -> None:
        body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4}}
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200

    printed = _replicas_serve(chat_model_dir, "--ray-address", ray_cluster.address, check=check)
    assert f"2 replicas on {ray_cluster.address} (2 node(s)" in printed
    assert ray.is_initialized() and len([n for n in ray.nodes() if n["Alive"]]) == 2
