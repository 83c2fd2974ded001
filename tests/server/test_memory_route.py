"""GET /memory on a real server, and `radixlang memory --url` reading it."""

from __future__ import annotations

import json

from radixlang.cli import main

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_memory_route_reports_the_engine(client, engine):
    assert client.post("/flush_cache").json()["success"] is True
    result = engine.generate("Where does the KV memory go?", GREEDY)
    response = client.get("/memory")
    assert response.status_code == 200
    report = response.json()
    assert report == engine.memory_report().to_dict()  # idle: nothing changed between them
    # One finished request: its prompt and all but its last output token, cached on one path.
    tokens = len(result.prompt_ids) + len(result.output_ids) - 1
    bs = report["block_size"]
    blocks = report["blocks"]
    assert blocks["used"] == blocks["tree_only"] == -(-tokens // bs)
    assert blocks["requests_only"] == blocks["both"] == blocks["unaccounted"] == 0
    assert blocks["free"] == blocks["total"] - blocks["used"] == engine.pool.num_free
    assert report["slots"]["live"] == tokens
    assert report["slots"]["allocated"] == blocks["used"] * bs
    assert report["sharing"] == {"logical_tokens": tokens, "live_tokens": tokens, "ratio": 1.0}
    assert report["running_requests"] == 0 and report["tier"] is None
    assert report["bytes_per_block"] == engine.runner.kv.num_bytes // engine.pool.num_blocks
    metrics = client.get("/metrics").text
    assert 'route="/memory",code="200"' in metrics


def test_memory_command_reads_a_server(server, client, tmp_path, capsys):
    expected = client.get("/memory").json()
    assert main(["memory", "--url", server.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    png = tmp_path / "memory.png"
    assert main(["memory", "--url", server.url, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"the server at {server.url}:" in out
    used, total = expected["blocks"]["used"], expected["blocks"]["total"]
    assert f"used {used}/{total}" in out and "tier      off" in out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_memory_command_names_an_unreachable_server(capsys):
    assert main(["memory", "--url", "http://127.0.0.1:1"]) == 2
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err


def test_save_cache_route_writes_the_cache_dir_or_says_why_not(client, engine, tmp_path):
    # The shared test server has no cache_dir: a 400 that says so.
    refused = client.post("/save_cache")
    assert refused.status_code == 400 and "--cache-dir" in refused.json()["error"]["message"]
    engine.generate("Save me", GREEDY)
    engine.cache_dir = tmp_path  # as if started with --cache-dir
    try:
        saved = client.post("/save_cache").json()
    finally:
        engine.cache_dir = None
    assert saved["success"] is True and saved["nodes"] >= 1 and saved["tokens"] > 0
    assert (tmp_path / "radix-cache.rlkv").stat().st_size == saved["bytes"]
