"""The REPL over ``--url``: the same chat, /fork and /stats against a real server on the tiny
chat model, started in this test."""

from __future__ import annotations

import re

import pytest
from repl_terminal import ReplTerminal, usages


@pytest.fixture(scope="module")
def server(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine) as srv:
        yield srv


@pytest.fixture()
def repl(server, tmp_path):
    terminal = ReplTerminal(["--url", server.url, "--max-tokens", "10"], home=tmp_path / "cache")
    yield terminal
    terminal.close()


def test_chat_fork_and_stats_over_a_server(repl, engine, server):
    engine.flush_cache()
    banner = repl.screen()
    assert f"({server.url})" in banner
    chat = repl.command("Say something.", "assistant", " generated · ")
    ((prompt, cached, computed, generated, _),) = usages(chat)
    assert cached == 0 and computed == prompt and 1 <= generated <= 10

    fork = repl.command("/fork 2", "continuing from [2]")
    branches = usages(fork[fork.rindex("┏") :])
    assert len(branches) == 2
    # Each branch's usage comes from the server's: its prompt was cached by the first turn.
    for branch_prompt, branch_cached, _, branch_generated, _ in branches:
        assert branch_prompt == prompt and branch_cached >= prompt - 1
        assert 1 <= branch_generated <= 10

    stats = repl.command("/stats", "generated tokens")
    assert re.search(r"requests\s+0 running, 0 waiting", stats)
    assert re.search(r"cache hit rate\s+[1-9]\d*\.\d%", stats)
    repl.command("/tree", "/tree is not available over --url")
    # Programs run on the server too (through RuntimeEndpoint), their gens streaming.
    repl.command("/load examples/fork_join.py", "loaded tips")
    run = repl.command("/run tips topic=tea num_tips=2 max_tokens=4", "prompt tokens: ")
    assert "[fork 1] detail" in run and "[fork 2] detail" in run
    repl.command("/back", "undid user: Say something.")

    assert repl.exit_with_ctrl_d() == 0
    assert engine.stats()["running_requests"] == 0
    engine.check_integrity()
