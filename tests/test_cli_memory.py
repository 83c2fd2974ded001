"""`radixlang memory` on a local engine: the built-in workload, reported while it decodes."""

from __future__ import annotations

import json

from radixlang.cli import main


def test_memory_runs_the_workload_and_reports_it_while_decoding(chat_model_dir, tmp_path, capsys):
    png = tmp_path / "memory.png"
    args = ["memory", "--model", str(chat_model_dir), "--dtype", "float32", "--kv-memory", "16MiB"]
    assert main([*args, "--max-new-tokens", "4", "--json", "--png", str(png)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert f"wrote {png}" in captured.err and png.read_bytes().startswith(b"\x89PNG")
    # All 7 requests decode at once, on blocks they share with the cached few-shot prompt.
    assert report["running_requests"] == 7
    blocks, slots, sharing = report["blocks"], report["slots"], report["sharing"]
    assert blocks["unaccounted"] == 0
    assert blocks["used"] == blocks["tree_only"] + blocks["requests_only"] + blocks["both"]
    assert blocks["both"] >= 2 and blocks["shared"] >= blocks["both"]
    assert 0 < slots["live"] <= slots["allocated"] == blocks["used"] * report["block_size"]
    assert sharing["ratio"] > 3  # 7 requests and their cached prompts over one shared prefix

    assert main([*args, "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "7 requests sharing a few-shot prompt (3 samples of one)" in out
    assert "sharing" in out and "fragmentation" in out
