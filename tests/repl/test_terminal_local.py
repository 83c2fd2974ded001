"""The REPL as a person uses it, in a real pseudo-terminal, on a local engine over a tiny
random chat model (the default model's tokenizer and chat template)."""

from __future__ import annotations

import json
import re

import pytest
from repl_terminal import ReplTerminal, leaves, tree_nodes, usages


@pytest.fixture(scope="module")
def long_chat_model_dir(tmp_path_factory):
    """The tiny chat model with a long context, so a reply can run long enough to stop."""
    from radixlang.testing import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-long"), max_positions=8192)


@pytest.fixture()
def repl(long_chat_model_dir, tmp_path):
    args = ["--model", str(long_chat_model_dir), "--kv-memory", "64MiB", "--max-tokens", "12"]
    terminal = ReplTerminal(args, home=tmp_path / "cache")
    yield terminal
    terminal.close()


def last_table(screen: str) -> str:
    """The final frame of a live table (earlier frames stay in the stream, overwritten)."""
    return screen[screen.rindex("┏") :]


def test_chat_fork_pick_back_tree_stats_and_ctrl_c(repl, tmp_path):
    # A chat turn streams its reply, then says what the cache reused.
    chat = repl.command("hello there", "assistant", " generated · ")
    ((prompt, cached, computed, generated, _),) = usages(chat)
    assert cached == 0 and computed == prompt and 1 <= generated <= 12

    # /fork 3: three more replies to the same message, side by side, from the cached prompt.
    fork = repl.command("/fork 3", "continuing from [2]")
    table = last_table(fork)
    header = next(line for line in table.splitlines() if "[2]" in line)
    assert "[3]" in header and "[4]" in header  # one row of columns
    branches = usages(table)
    assert len(branches) == 3
    for branch_prompt, branch_cached, branch_computed, _, _ in branches:
        assert branch_prompt == prompt and branch_cached == prompt - 1 and branch_computed == 1

    repl.command("/pick 2", "continuing from [2]: assistant:")
    listed = repl.command("/branches", "replies to: hello there")
    rows = [line for line in listed.splitlines() if re.match(r"^│ [1-4] │", line)]
    assert len(rows) == 4 and "*" in rows[1] and "*" not in rows[0] + rows[2] + rows[3]

    # The radix tree: the shared prompt once, the four replies below it.
    nodes = tree_nodes(repl.command("/tree", "blocks held by the tree"))
    (top,) = [n for n in nodes if n[0] == 0]
    assert top[2].startswith('"<|im_start|>system')
    # Every prompt token sits on the one path above the replies (the fork split it where
    # the branches' requests matched, before the prompt's last token).
    replies = leaves(nodes)
    assert len(replies) == 4 and len({depth for depth, _, _ in replies}) == 1
    above = [tokens for depth, tokens, _ in nodes if depth < replies[0][0]]
    assert sum(above) == prompt

    stats = repl.command("/stats", "integrity")
    assert re.search(r"blocks held by requests\s+0\b", stats)
    assert re.search(r"requests\s+0 running, 0 waiting", stats)
    assert re.search(r"integrity\s+ok", stats)

    # Ctrl-C during a long reply stops it and keeps the session; nothing stays held. The reply
    # cannot end by itself first (ignore_eos: 6,000 tokens), however short its text would be.
    repl.command("/set max_tokens 6000", "max_tokens = 6000")
    repl.command("/set ignore_eos on", "ignore_eos = True")
    repl.command("/set temperature 0", "temperature = 0.0")
    start = repl.mark()
    repl.type("Tell me a very long story.")
    repl.expect("assistant")
    repl.child.expect(r"\w{3}")  # the reply has begun streaming
    repl.child.sendintr()
    repl.expect("stopped: the requests were aborted")
    repl.expect("radixlang>")
    ((_, _, _, generated, finish),) = usages(repl.screen(start))
    assert finish == "stopped" and generated < 6000
    stats = repl.command("/stats", "integrity")
    assert re.search(r"blocks held by requests\s+0\b", stats)
    assert re.search(r"requests\s+0 running, 0 waiting", stats)
    assert re.search(r"integrity\s+ok", stats)

    # Mistakes are messages; the session goes on.
    repl.command("/frok 2", "unknown command /frok (did you mean /fork?)")
    repl.command("/set temperature hot", "temperature must be a number, got 'hot'")
    repl.command("/pick 9", "no branch 9: pick 1 to ")
    repl.command("/load nowhere.py", "no such file: nowhere.py")

    # /back, then /save: the transcript keeps every branch.
    repl.command("/set max_tokens 8", "max_tokens = 8")
    repl.command("/back", "undid user: Tell me a very long story.")
    path = tmp_path / "chat.json"
    repl.command(f"/save {path}", "saved ")
    data = json.loads(path.read_text())
    (hello,) = data["tree"]["children"]
    replies = hello["children"]
    assert hello["content"] == "hello there" and len(replies) == 4
    assert [m["content"] for m in data["messages"]] == ["hello there", replies[1]["content"]]
    story = replies[1]["children"][0]
    assert story["content"] == "Tell me a very long story."
    assert story["children"][0]["usage"]["finish_reason"] == "abort"
    # What streamed on the screen is what the transcript holds.
    first_words = " ".join(replies[0]["content"].split()[:3])
    assert first_words in " ".join(chat.split())
    assert data["settings"]["temperature"] == 0.0

    assert repl.exit_with_ctrl_d() == 0


def test_programs_multiline_input_and_history(repl, tmp_path):
    repl.command("/load examples/fork_join.py", "loaded tips(topic, num_tips, max_tokens)")
    run = repl.command(
        "/run tips topic=tea num_tips=2 max_tokens=6",
        "prompt tokens: ",
    )
    final = run[run.rindex("[main] title_0") :]  # the last frame: every gen, in tree order
    at = [final.index(label) for label in ("[main] title_1", "[fork 1] detail", "[fork 2] detail")]
    assert at == sorted(at)
    assert re.search(r"prompt tokens: [1-9]\d* from the cache, \d+ computed", run)

    graph = repl.command("/graph tips num_tips=2", "call graph of tips")
    assert "fork 2 branches" in graph and "branch 1" in graph and "branch 2" in graph
    assert "argument topic" in graph

    repl.command("/run nothing", "no program 'nothing' (programs: tips)")
    repl.command("/run tips topic=tea", "tips needs num_tips=..., max_tokens=...")

    # Multi-line messages: a trailing backslash, or Esc then Enter, starts a new line.
    repl.child.send("first line\\\r")
    repl.child.send("second line\x1b\r")
    repl.command("third line", " generated · ")
    path = tmp_path / "t.json"
    repl.command(f"/save {path}", "saved ")
    messages = json.loads(path.read_text())["messages"]
    assert messages[0] == {"role": "user", "content": "first line\nsecond line\nthird line"}

    assert repl.exit_with_ctrl_d() == 0
    history = (tmp_path / "cache" / "radixlang" / "repl_history").read_text()
    assert "/load examples/fork_join.py" in history
    assert "first line\n+second line\n+third line" in history  # one entry, three lines
