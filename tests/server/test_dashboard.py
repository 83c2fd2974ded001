"""The dashboard's JSON API (``docs/dashboard.md``) on a live server: the snapshot's figures
against the engine and /metrics, the block map, the history, programs reported over HTTP and
refused when malformed, the event stream (one sampler for every watcher), keys and tenants,
and ``--no-dashboard``."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from radixlang.server import metrics
from radixlang.server.app import serve_in_thread


def _events(url: str, count: int, headers: dict | None = None, into: list | None = None) -> list:
    out = [] if into is None else into
    with httpx.stream("GET", url + "/dashboard/api/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if len(out) == count:
                    return out
    return out


def test_the_snapshot_describes_the_engine_and_matches_metrics(client, engine):
    body = {"text": ["A shared opening line, then one", "A shared opening line, then two"],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
    assert client.post("/generate", json=body).status_code == 200
    snap = client.get("/dashboard/api/snapshot").json()
    assert snap["model"] == engine.files.name
    scraped = metrics.parse(client.get("/metrics").text)
    # Every engine figure of /metrics (all but the HTTP counters), none missing, none extra.
    engine_figures = {name for name in scraped if not name.startswith(metrics.PREFIX + "http_")}
    assert set(snap["metrics"]) == engine_figures
    assert snap["metrics"][metrics.PREFIX + "generated_tokens_total"] >= 8  # this test's 2 x 4
    for name, value in snap["metrics"].items():  # idle: nothing moves between the two reads
        if not name.endswith("per_second"):
            assert scraped[name] == pytest.approx(value), name
    tree = snap["tree"]
    texts = [n["text"] for n in tree["nodes"]]
    assert any("A shared opening line" in t for t in texts), texts
    assert all(0.0 <= n["recency"] <= 1.0 for n in tree["nodes"])
    pool = snap["pool"]
    assert pool["used"] == pool["evictable"] + pool["held"] and pool["held"] == 0
    assert pool["free"] + pool["used"] == pool["total"]
    cells = sum(run[2] for run in pool["map"]["runs"])
    assert cells == pool["map"]["cells"]
    blocks_in_map = sum(run[2] for run in pool["map"]["runs"] if run[0] != "free")
    if pool["map"]["blocks_per_cell"] == 1:
        assert blocks_in_map == pool["used"]
    for state, owner, _ in pool["map"]["runs"]:
        assert (state == "free") == (pool["map"]["owners"][owner] == "")
    assert snap["requests"] == []


def test_history_has_a_point_per_interval_with_interval_figures(client):
    # The sampler adds a point every interval (a second here, the default): wait for two,
    # however long a loaded machine takes to sample (a sampler that adds none never gets there).
    points: list[dict] = []

    def two_points() -> bool:
        points[:] = client.get("/dashboard/api/history").json()["points"]
        return len(points) >= 2

    _wait_until(two_points, timeout=60)
    for p in points:
        assert p["blocks_used"] == p["blocks_evictable"] + p["blocks_held"]
        assert 0.0 <= p["cache_hit_rate"] <= 1.0 and p["tokens_per_second"] >= 0
    assert points[-1]["time"] > points[0]["time"]


def test_programs_are_kept_and_malformed_ones_refused(client):
    graph = {"nodes": [{"id": 0, "kind": "text", "label": "Q", "chain": 0},
                       {"id": 1, "kind": "gen", "label": "a", "chain": 0,
                        "prompt_tokens": 9, "cached_tokens": 7, "completion_tokens": 3}],
             "edges": [{"src": 0, "dst": 1, "kind": "prefix"}]}  # fmt: skip
    before = client.get("/dashboard/api/programs").json()["version"]
    r = client.post("/dashboard/api/programs", json={"name": "qa", "graph": graph})
    assert r.status_code == 200
    listed = client.get("/dashboard/api/programs").json()
    assert listed["version"] == before + 1
    assert listed["programs"][-1]["id"] == r.json()["id"]
    assert listed["programs"][-1]["graph"] == graph
    assert client.get("/dashboard/api/snapshot").json()["programs_version"] == before + 1
    bad = [
        {"graph": graph},  # no name
        {"name": "x", "graph": {"nodes": [{"id": 0, "kind": "loop", "label": "", "chain": 0}]}},
        {"name": "x", "graph": {"nodes": [], "edges": [{"src": 0, "dst": 1, "kind": "x"}]}},
        {"name": "x", "graph": graph, "colour": "red"},
    ]
    for body in bad:
        r = client.post("/dashboard/api/programs", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"]
    assert client.get("/dashboard/api/programs").json()["version"] == before + 1


def test_one_sampler_serves_every_watcher(engine):
    with serve_in_thread(engine, dashboard_interval=0.2) as srv:
        calls = []
        real_view = engine.view

        def counted_view(*a, **k):  # type: ignore[no-untyped-def]
            calls.append(time.monotonic())
            return real_view(*a, **k)

        engine.view = counted_view  # type: ignore[method-assign]
        try:
            results: list[list[dict]] = [[] for _ in range(4)]
            watchers = [threading.Thread(target=lambda i=i: results[i].extend(_events(srv.url, 6)))
                        for i in range(4)]  # fmt: skip
            started = time.monotonic()
            for w in watchers:
                w.start()
            for w in watchers:
                w.join(30)
            elapsed = time.monotonic() - started
        finally:
            del engine.view
        assert all(len(r) == 6 for r in results)
        # Each watcher's first snapshot is its own; after that one view per interval is shared.
        assert len(calls) <= 4 + elapsed / 0.2 + 2, (len(calls), elapsed)
        assert all(r[-1]["point"] is not None for r in results)


def test_a_tenant_key_is_refused_and_the_operator_key_opens_it(engine, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenant-key": "acme"}))
    with serve_in_thread(engine, api_key="operator", api_keys_file=str(keys)) as srv:
        assert httpx.get(srv.url + "/dashboard").status_code == 200  # the page: no data
        assert httpx.get(srv.url + "/dashboard/static/dashboard.js").status_code == 200
        assert httpx.get(srv.url + "/dashboard/static/nothing.js").status_code == 404
        r = httpx.get(srv.url + "/dashboard/api/snapshot")
        assert r.status_code == 401
        tenant = {"Authorization": "Bearer tenant-key"}
        r = httpx.get(srv.url + "/dashboard/api/snapshot", headers=tenant)
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/generate", headers=tenant, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200  # fmt: skip
        operator = {"Authorization": "Bearer operator"}
        assert httpx.get(srv.url + "/dashboard/api/snapshot", headers=operator).status_code == 200
        assert _events(srv.url, 1, operator)[0]["tree"]["nodes"]


def test_no_dashboard_serves_none_of_it(engine):
    with serve_in_thread(engine, dashboard=False) as srv:
        for path in ("/dashboard", "/dashboard/api/snapshot", "/dashboard/api/events",
                     "/dashboard/static/dashboard.js"):  # fmt: skip
            assert httpx.get(srv.url + path).status_code == 404, path
        assert httpx.get(srv.url + "/health").status_code == 200


def test_the_serve_flags_reach_the_app():
    from radixlang.cli import build_parser
    from radixlang.config import config_from_args

    args = build_parser().parse_args(["serve", "--no-dashboard", "--dashboard-interval", "0.5"])
    server = config_from_args(args, environ={}).server_kwargs()
    assert server["dashboard"] is False and server["dashboard_interval"] == 0.5
    args = build_parser().parse_args(["serve"])
    server = config_from_args(args, environ={}).server_kwargs()
    assert server["dashboard"] is True and server["dashboard_max_nodes"] == 150
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dashboard-interval", "0"])


def test_an_open_page_does_not_hold_up_a_shutdown(engine):
    """An event stream never ends by itself: a stopping server ends it rather than wait out
    its drain timeout."""
    from radixlang.server.app import ServerThread

    # A drain timeout far beyond any shutdown's time: a stop that waited for the open stream
    # would take it all, and the stream would be cut off rather than ended.
    drain = 120.0
    server = ServerThread(engine, drain_timeout=drain, dashboard_interval=0.2)
    got: list[dict] = []
    ended: list[str] = []

    def read() -> None:
        try:
            _events(server.url, 1000, into=got)
            ended.append("ended")  # the server closed the stream: a complete response
        except httpx.HTTPError as e:  # cut off (the drain timed out and cancelled it)
            ended.append(f"cut off: {type(e).__name__}: {e}")

    reader = threading.Thread(target=read)
    reader.start()
    _wait_until(lambda: len(got) >= 2)
    started = time.monotonic()
    server.stop()
    stopped_after = time.monotonic() - started
    reader.join(60)
    assert not reader.is_alive()
    assert ended == ["ended"]
    assert len(got) < 1000  # the stream ended because the server stopped, not by the count
    assert stopped_after < drain / 2, stopped_after


def _wait_until(condition, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_snapshots_fit_the_openapi_schema(server, client):
    """The event stream is left out of the schemathesis run (it never ends): its events and the
    other dashboard answers are checked against /openapi.json here."""
    import jsonschema

    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    events = paths["/dashboard/api/events"]["get"]["responses"]["200"]["content"]
    item = events["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert item["contentSchema"] == {"$ref": "#/components/schemas/DashboardSnapshot"}

    def check(value: object, name: str) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        jsonschema.validate(value, schema)

    for event in _events(server.url, 2):
        check(event, "DashboardSnapshot")
    check(client.get("/dashboard/api/snapshot").json(), "DashboardSnapshot")
    check(client.get("/dashboard/api/history").json(), "DashboardHistory")
    check(client.get("/dashboard/api/programs").json(), "ProgramList")
    assert "/dashboard" not in paths  # the page is a static file, not an API operation
