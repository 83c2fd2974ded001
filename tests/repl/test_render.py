"""What the REPL draws, on a recording console: streamed text, forks side by side, the tree."""

from __future__ import annotations

import io
import re

from rich.console import Console

from radixlang.repl import render
from radixlang.repl.session import Usage


def console(width: int = 100) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)


def test_a_reply_is_written_piece_by_piece():
    out = console()
    view = render.ReplyView(out)
    view.add(0, "Hello [bold]")  # model text, not markup
    assert out.file.getvalue().endswith("Hello [bold]")  # written before the next piece
    view.add(0, " world")
    view.done(0, Usage(40, 30, 2, "stop"))
    view.close()
    text = out.file.getvalue()
    assert "Hello [bold] world\n" in text
    assert "40 prompt tokens: 30 from the cache, 10 computed · 2 generated · stop" in text


def test_forks_print_side_by_side_with_their_usage():
    out = console(120)
    view = render.ForkView(out, ["[2]", "[3]"])
    view.add(0, "alpha")
    view.add(1, "beta")
    view.done(0, Usage(20, 19, 1, "length"))
    view.done(1, None, error="boom")
    view.close()
    text = out.file.getvalue()
    header = next(line for line in text.splitlines() if "[2]" in line)
    assert "[3]" in header  # one row: the branches are columns
    row = next(line for line in text.splitlines() if "alpha" in line)
    assert "beta" in row
    assert "from the cache" in text and "error: boom" in text


def test_the_cache_tree_draws_a_shared_prefix_once():
    node = dict(start=0, blocks=[1], own_blocks=1, block_refs=[3], hits=2, lock_ref=0, age=1)
    tree = {
        "num_nodes": 3, "shown_nodes": 3, "tree_blocks": 3, "token_ids": [], "children": [
            {**node, "token_ids": [1, 2], "end": 2, "children": [
                {**node, "token_ids": [3], "start": 2, "end": 3, "children": [], "age": 0},
                {**node, "token_ids": [4], "start": 2, "end": 3, "children": [], "lock_ref": 1},
            ]},
        ],
    }  # fmt: skip
    words = {1: "<|im_start|>", 2: "user\n", 3: "yes", 4: "no"}
    out = Console(record=True, width=100, color_system=None, file=io.StringIO())
    out.print(render.cache_tree(tree, lambda ids: "".join(words[i] for i in ids), 100))
    lines = out.export_text().splitlines()
    assert lines[0] == "radix cache: 3 nodes, 3 blocks held by the tree"
    assert lines[1].startswith('└── "<|im_start|>user\\n"  2 tok · 1 blk · hits 2 · lock 0')
    assert lines[2].startswith('    ├── "yes"  1 tok') and lines[2].endswith("age 0")
    assert lines[3].startswith('    └── "no"') and "lock 1 · refs 3 · age 1" in lines[3]


def test_the_cache_tree_shows_other_salts_trees_apart():
    node = dict(start=0, end=1, blocks=[1], own_blocks=1, block_refs=[1], hits=0, lock_ref=0,
                age=0, children=[])  # fmt: skip
    tree = {
        "num_nodes": 2, "shown_nodes": 2, "tree_blocks": 2, "token_ids": [],
        "children": [{**node, "token_ids": [3]}],
        "salted_roots": [{**node, "salt": "alice", "token_ids": [], "children": [
            {**node, "token_ids": [4]}]}],
    }  # fmt: skip
    out = Console(record=True, width=100, color_system=None, file=io.StringIO())
    out.print(render.cache_tree(tree, lambda ids: {3: "yes", 4: "no"}[ids[0]], 100))
    lines = out.export_text().splitlines()
    assert lines[1].startswith('├── "yes"')
    assert lines[2] == "└── cache salt 'alice'"
    assert lines[3].startswith('    └── "no"  1 tok')


def test_edge_text_escapes_and_cuts_in_the_middle():
    assert render.edge_text('a\nb"c') == '"a\\nb\\"c"'
    cut = render.edge_text("x" * 30 + "y" * 30, limit=21)
    assert cut == '"' + "x" * 10 + "…" + "y" * 10 + '"'


def test_stats_show_blocks_requests_and_integrity():
    stats = {"cache_hit_rate": 0.5, "prompt_tokens": 10, "prompt_tokens_reused": 5,
             "prompt_tokens_computed": 5, "blocks_used": 3, "blocks_free": 7,
             "blocks_evictable": 2, "blocks_total": 10, "running_requests": 0,
             "waiting_requests": 0, "blocks_held_by_requests": 0, "integrity": "ok"}  # fmt: skip
    out = Console(record=True, width=100, color_system=None, file=io.StringIO())
    out.print(render.stats_table(stats))
    lines = [line.strip() for line in out.export_text().splitlines() if line.strip()]
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)
    assert rows["cache hit rate"] == "50.0%"
    assert rows["blocks"] == "3 used, 7 free, 2 evictable (of 10)"
    assert rows["blocks held by requests"] == "0"
    assert rows["requests"] == "0 running, 0 waiting"
    assert rows["integrity"] == "ok"
