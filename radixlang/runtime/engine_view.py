"""What a viewer (the dashboard) sees of a running engine: the radix tree's largest nodes, who
holds each KV block, and the queued and running requests.

Every function here reads engine state and must run on the engine thread, between steps
(``Engine.view()`` calls them there). They copy plain numbers and token ids and nothing else:
decoding text, run-length coding and JSON are the caller's work, on its own thread, so that a
viewer costs the engine as little time as possible.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import Any

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.request import Req, ReqStatus
from radixlang.runtime.scheduler import RELEASED

HEAD_TOKENS = 64  # of a node's edge: enough text to recognise it
TAIL_TOKENS = 128  # of a request's output so far (the page shows its last 400 characters)

# Block states, by code (a bytearray holds one per block).
FREE, CACHED, LOCKED, REQUEST = 0, 1, 2, 3
BLOCK_STATES = ("free", "cached", "locked", "request")


def tree_view(cache: RadixCache, max_nodes: int) -> dict[str, Any]:
    """The roots and the ``max_nodes`` nodes with the largest subtrees (in tokens), parents
    before children; per shown parent, how many children (nodes, tokens) were left out.

    A parent's subtree is larger than any child's (every non-root node has tokens), so the
    largest subtrees always include the parents of those chosen: the view is a tree."""
    roots = cache.roots()
    order: list[tuple[Any, Any, str]] = []  # (node, parent, salt), preorder
    stack = [(child, root, salt) for salt, root in reversed(roots)
             for child in reversed(list(root.children.values()))]  # fmt: skip
    while stack:
        node, parent, salt = stack.pop()
        order.append((node, parent, salt))
        stack.extend((c, node, salt) for c in node.children.values())
    subtree_tokens: dict[int, int] = {}
    subtree_nodes: dict[int, int] = {}
    for node, parent, _ in reversed(order):  # children before parents
        subtree_tokens[node.id] = subtree_tokens.get(node.id, 0) + len(node.tokens)
        subtree_nodes[node.id] = subtree_nodes.get(node.id, 0) + 1
        subtree_tokens[parent.id] = subtree_tokens.get(parent.id, 0) + subtree_tokens[node.id]
        subtree_nodes[parent.id] = subtree_nodes.get(parent.id, 0) + subtree_nodes[node.id]
    chosen = heapq.nlargest(max_nodes, order, key=lambda item: subtree_tokens[item[0].id])
    shown = {node.id for node, _, _ in chosen}
    clock = cache.clock
    rows = []
    for salt, root in roots:
        if salt and not any(c.id in shown for c in root.children.values()):
            continue
        rows.append(_row(root, None, salt, subtree_tokens.get(root.id, 0), clock))
        shown.add(root.id)
    rows += [
        _row(node, parent.id, salt, subtree_tokens[node.id], clock)
        for node, parent, salt in order
        if node.id in shown
    ]
    hidden: dict[int, list[int]] = {}
    for node, parent, _ in order:
        if node.id not in shown and parent.id in shown:
            left_out = hidden.setdefault(parent.id, [0, 0])
            left_out[0] += subtree_nodes[node.id]
            left_out[1] += subtree_tokens[node.id]
    return {
        "nodes": rows,
        "hidden": [{"parent": p, "nodes": n, "tokens": t} for p, (n, t) in hidden.items()],
        "num_nodes": len(order),
        "shown_nodes": len(rows) - sum(1 for r in rows if r["parent"] is None),
        "cached_tokens": cache.cached_tokens,
        "evictions": list(cache.evictions),
        "evicted_blocks_total": cache.evicted_blocks_total,
    }


def _row(node: Any, parent: int | None, salt: str, subtree: int, clock: int) -> dict[str, Any]:
    return {
        "id": node.id,
        "parent": parent,
        "salt": salt,
        "start": node.start,
        "end": node.end,
        "tokens": len(node.tokens),
        "subtree_tokens": subtree,
        "head_ids": list(node.tokens[:HEAD_TOKENS]),
        "blocks": len(node.blocks),
        "tier_blocks": len(node.host_blocks),
        "hits": node.hits,
        "lock_ref": node.lock_ref,
        "age": clock - node.last_access,
    }


def block_owners(
    pool: BlockPool, cache: RadixCache, running: Sequence[Req]
) -> tuple[bytearray, list[int], list[str]]:
    """Each block's state (``BLOCK_STATES`` codes) and holder: an index into the holder names
    (``node <id>`` or ``request <rid>``), -1 for a free block. A block the tree holds is named
    by the first node that holds it, locked if any running path includes a holder."""
    states = bytearray(pool.num_blocks)
    owners = [-1] * pool.num_blocks
    names: list[str] = []
    stack = [child for _, root in cache.roots() for child in root.children.values()]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.blocks:
            continue
        names.append(f"node {node.id}")
        code = LOCKED if node.lock_ref else CACHED
        for b in node.blocks:
            if states[b] == FREE:
                owners[b] = len(names) - 1
            states[b] = max(states[b], code)
    for req in running:
        names.append(f"request {req.rid}")
        for b in req.blocks:
            if b != RELEASED and states[b] == FREE:
                states[b], owners[b] = REQUEST, len(names) - 1
    return states, owners, names


def request_rows(running: Sequence[Req], waiting: Sequence[Req]) -> list[dict[str, Any]]:
    """The running requests, then the waiting ones in queue order."""
    now = time.perf_counter()
    rows = []
    for req in [*running, *waiting]:
        if req.status is ReqStatus.RUNNING:
            state = "prefill" if req.is_prefilling else "decode"
        else:
            state = "retracted" if req.num_retractions else "waiting"
        prompt = req.prompt_len
        reused = min(req.cached_tokens, prompt)
        computed = max(0, min(req.num_computed, prompt) - reused)
        rows.append({
            "rid": req.rid,
            "state": state,
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "computed_tokens": computed,
            "output_tokens": req.num_output,
            "max_new_tokens": req.output_limit,
            "retractions": req.num_retractions,
            "age": now - req.arrival,
            "salt": req.cache_salt,
            "prompt_tail_ids": list(req.prompt_ids[-HEAD_TOKENS:]),
            "output_tail_ids": list(req.tokens[max(prompt, len(req.tokens) - TAIL_TOKENS):]),
        })  # fmt: skip
    return rows
