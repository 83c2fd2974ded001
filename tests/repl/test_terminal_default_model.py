"""The REPL on the real default model, in a pseudo-terminal: a short chat, /fork 2, /tree."""

from __future__ import annotations

import json

import pytest
from repl_terminal import ReplTerminal, leaves, tree_nodes, usages


@pytest.mark.slow
def test_chat_fork_and_tree_on_the_default_model(tmp_path):
    args = ["--dtype", "bfloat16", "--kv-memory", "256MiB", "--max-tokens", "24"]
    repl = ReplTerminal(args, home=tmp_path / "cache", timeout=300)
    try:
        repl.command("/set seed 1", "seed = 1")
        chat = repl.command("What is a radix tree? One sentence.", "assistant", " generated · ")
        ((prompt, cached, _, generated, _),) = usages(chat)
        assert cached == 0 and generated >= 1
        fork = repl.command("/fork 2", "continuing from [2]")
        for branch_prompt, branch_cached, *_ in usages(fork[fork.rindex("┏") :]):
            assert branch_prompt == prompt and branch_cached == prompt - 1
        nodes = tree_nodes(repl.command("/tree", "blocks held by the tree"))
        path = tmp_path / "chat.json"
        repl.command(f"/save {path}", "saved ")
        assert repl.exit_with_ctrl_d() == 0
    finally:
        repl.close()
    (question,) = json.loads(path.read_text())["tree"]["children"]
    replies = {reply["content"] for reply in question["children"]}
    # The shared prompt appears once, at the top; one leaf per distinct reply below it.
    assert [n for n in nodes if n[0] == 0] == nodes[:1]
    assert nodes[0][2].startswith('"<|im_start|>system')
    assert len(leaves(nodes)) == len(replies) >= 2
