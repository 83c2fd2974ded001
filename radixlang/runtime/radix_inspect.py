"""Looking into a :class:`~radixlang.runtime.radix_cache.RadixCache` without changing it: the
integrity check (the tree, its counters, its heaps and the pool agree) and the tree as plain
dicts (``describe``, for the REPL's /tree and the dashboard) or text (``render``).

Apart from ``radix_cache.py``, which keeps the tree's operations, and read by the cache's own
``check_integrity``/``describe``/``render``. These functions read the cache's private fields:
they are its inspection, not another client. They take the cache untyped (``Any``) so that this
module imports nothing of ``radix_cache`` (which imports it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any

from radixlang.runtime.block_pool import IntegrityError
from radixlang.runtime.radix_node import retained_stamp, tier_stamp


def check_integrity(cache: Any, external_refs: Mapping[int, int] | None = None) -> None:
    """Raise :class:`IntegrityError` unless the tree, its counters and the pool agree.

    ``external_refs`` (block -> references held outside the tree, e.g. by running requests)
    makes the pool check exact: every refcount must equal tree holders plus external ones.
    """
    bs = cache.block_size
    holders: dict[int, list[tuple[Any, int]]] = {}
    tier_holders: dict[int, list[tuple[Any, int]]] = {}
    evictable = protected = nodes = tokens = tiered_tokens = 0
    candidates: dict[Any, int] = {}
    retained_candidates: dict[Any, int] = {}
    tier_candidates: dict[Any, int] = {}
    _expect(cache._roots.get("") is cache.root, "the default salt's root is not the root")
    _expect(
        cache._root_salts == {r: salt for salt, r in cache._roots.items()},
        "the roots' salts disagree with the roots",
    )
    for salt, root in cache._roots.items():
        _expect(root.parent is None and not root.tokens, f"salt {salt!r}: not a root")
        _expect(salt == "" or bool(root.children), f"salt {salt!r}: an empty root is kept")
    stack = list(cache._roots.values())
    while stack:
        node = stack.pop()
        children_locks = 0
        for first_token, child in node.children.items():
            _expect(child.parent is node, f"node {child.id}: wrong parent")
            _expect(bool(child.tokens), f"node {child.id}: empty key")
            _expect(child.tokens[0] == first_token, f"node {child.id}: keyed by wrong token")
            _expect(child.start == node.end, f"node {child.id}: starts at {child.start}")
            _expect(not child.evicted, f"node {child.id}: evicted but still in the tree")
            children_locks += child.lock_ref
            stack.append(child)
        if node.parent is None:
            continue
        nodes += 1
        first, last = node.start // bs, (node.end - 1) // bs
        if cache.kv_events is not None:
            named = node.end // bs - first
            _expect(len(node.hashes) == named, f"node {node.id}: hashes for {named} blocks")
        device_children = [c for c in node.children.values() if not c.tiered]
        if node.tiered:
            _expect(cache.tier is not None, f"node {node.id}: tiered, but there is no tier")
            _expect(not node.blocks, f"node {node.id}: tiered but holds device blocks")
            _expect(
                len(node.host_blocks) == last - first + 1,
                f"node {node.id}: {len(node.host_blocks)} tier blocks for {first}..{last}",
            )
            _expect(node.own_blocks == 0, f"node {node.id}: tiered with own device blocks")
            _expect(not device_children, f"node {node.id}: a device node under a tiered one")
            tiered_tokens += len(node.tokens)
            if not node.lock_ref and not node.children:
                tier_candidates[node] = tier_stamp(node)
            for j, b in enumerate(node.host_blocks):
                tier_holders.setdefault(b, []).append((node, first + j))
            continue
        tokens += len(node.tokens)
        _expect(
            len(node.blocks) == last - first + 1,
            f"node {node.id}: {len(node.blocks)} blocks for indices {first}..{last}",
        )
        _expect(node.lock_ref >= children_locks, f"node {node.id}: lock below its children")
        own = cache._count_own_blocks(node)
        _expect(own == node.own_blocks, f"node {node.id}: own blocks {node.own_blocks}!={own}")
        if node.lock_ref:
            protected += own
        else:
            evictable += own
            if not device_children:
                if node.retained_until:
                    retained_candidates[node] = retained_stamp(node)
                else:
                    candidates[node] = node.last_access
        for j, b in enumerate(node.blocks):
            holders.setdefault(b, []).append((node, first + j))
    _expect(nodes == cache._num_nodes, f"node count {cache._num_nodes} != {nodes}")
    _expect(tokens == cache._cached_tokens, f"token count {cache._cached_tokens} != {tokens}")
    _expect(tiered_tokens == cache._tiered_tokens, "tiered token count is off")
    _expect(tier_candidates == cache._tier_candidates, "tier candidates differ from the tree")
    tier_live = {(stamp, node.id) for stamp, _, node in cache._tier_heap}
    for node, stamp in tier_candidates.items():
        _expect((stamp, node.id) in tier_live, f"tiered leaf {node.id} has no heap entry")
    _expect(evictable == cache._evictable_blocks, "evictable size counter is off")
    _expect(protected == cache._protected_blocks, "protected size counter is off")
    _expect(candidates == cache._candidates, "eviction candidates differ from the tree")
    live = {(stamp, node.id) for stamp, _, node in cache._heap}
    for node, stamp in candidates.items():
        _expect((stamp, node.id) in live, f"leaf {node.id} has no live heap entry")
    _expect(retained_candidates == cache._retained_candidates, "retained leaves differ")
    live = {(stamp, node.id) for stamp, _, node in cache._retained_heap}
    for node, stamp in retained_candidates.items():
        _expect((stamp, node.id) in live, f"retained leaf {node.id} has no live heap entry")
    for key, paths in cache._retained.items():
        for node in paths:
            _expect(not node.evicted, f"key {key!r} retains node {node.id}, which left the tree")
            _expect(node.retained_until >= paths[node], f"node {node.id}: deadline is off")
    for b, hs in (*holders.items(), *tier_holders.items()):
        if len(hs) > 1:  # one block, several nodes: an ancestor chain at one index
            _expect(len({i for _, i in hs}) == 1, f"block {b} held at two block indices")
            chain = sorted((n for n, _ in hs), key=lambda n: n.start)
            for up, down in pairwise(chain):
                _expect(_is_ancestor(up, down), f"block {b} shared by nodes on two branches")
    loading_device, loading_host = cache.ticket_refs()  # loads in flight (tier_prefetch.py)
    if cache.tier is not None:  # only the tree and loads hold tier blocks: the counts are exact
        tier_refs = Counter({b: len(hs) for b, hs in tier_holders.items()})
        cache.tier.pool.check_integrity(tier_refs + Counter(loading_host))
    tree_refs = Counter({b: len(hs) for b, hs in holders.items()}) + Counter(loading_device)
    if external_refs is None:
        for b, k in tree_refs.items():
            _expect(cache.pool.refcount(b) >= k, f"block {b}: refcount below tree holders")
        cache.pool.check_integrity()
    else:
        cache.pool.check_integrity(tree_refs + Counter(external_refs))


def describe(cache: Any, max_nodes: int | None = None) -> dict[str, Any]:
    """The tree as nested plain dicts (JSON-ready), for viewers such as the REPL's /tree.

    Each node: ``id``, ``start``/``end`` (its token positions), ``token_ids`` (its edge),
    ``blocks`` (pool ids), ``own_blocks`` (blocks no ancestor also holds), ``block_refs``
    (each block's pool reference count: tree holders plus running requests), ``hits``
    (matches that passed through it), ``tier_blocks`` (host-tier ids when its KV was
    evicted to the tier, and then ``blocks`` is empty), ``lock_ref`` (running requests
    whose path includes it), ``age`` (cache operations since it was last matched or
    inserted: its LRU age) and ``children`` (by first token). The root (``id`` 0, no
    tokens) also carries ``num_nodes``, ``shown_nodes`` (at most ``max_nodes``, depth-first) and
    ``tree_blocks``, the distinct blocks the tree holds, and ``salted_roots``: the roots of
    the other cache salts' trees (each with its ``salt``), which count in those figures too.
    Read it where nothing mutates the cache (the engine thread: ``Engine._call``)."""
    shown = 0
    tree_blocks: set[int] = set()

    def info(node: Any) -> dict[str, Any]:
        tree_blocks.update(node.blocks)
        return {
            "id": node.id,
            "start": node.start,
            "end": node.end,
            "token_ids": list(node.tokens),
            "blocks": list(node.blocks),
            "own_blocks": node.own_blocks,
            "block_refs": [cache.pool.refcount(b) for b in node.blocks],
            "tier_blocks": list(node.host_blocks),
            "hits": node.hits,
            "lock_ref": node.lock_ref,
            "age": cache._clock - node.last_access,
            "children": [],
        }

    root = info(cache.root)
    salted = [info(r) | {"salt": salt} for salt, r in cache._roots.items() if salt]
    pairs = list(zip(cache._roots.values(), [root, *salted], strict=True))
    stack = [
        (child, root_info)
        for r, root_info in reversed(pairs)
        for child in reversed(ordered_children(r))
    ]
    while stack:
        node, parent_info = stack.pop()
        if max_nodes is not None and shown >= max_nodes:
            tree_blocks.update(node.blocks)  # counted, though not shown
            stack.extend((c, parent_info) for c in node.children.values())
            continue
        shown += 1
        node_info = info(node)
        parent_info["children"].append(node_info)
        stack.extend((c, node_info) for c in reversed(ordered_children(node)))
    root.update(
        num_nodes=cache._num_nodes,
        shown_nodes=shown,
        tree_blocks=len(tree_blocks),
        salted_roots=salted,
    )
    return root


def render(
    cache: Any,
    decode: Callable[[list[int]], str] | None = None,
    max_nodes: int = 200,
    max_chars: int = 32,
) -> str:
    """The tree as text: one line per node with its span, blocks, hits and lock count."""
    s = cache.stats()
    lines = [
        f"radix cache: {s['nodes']} nodes, {s['cached_tokens']} tokens, "
        f"{s['evictable_blocks']} evictable + {s['protected_blocks']} protected blocks, "
        f"pool {s['pool_free_blocks']}/{s['pool_total_blocks']} free, "
        f"hit rate {s['hit_rate']:.1%}"
    ]
    shown = 0
    stack: list[tuple[Any | str, str, bool]] = []
    for salt, root in reversed(cache._roots.items()):
        kids = ordered_children(root)
        stack.extend((c, "", i == len(kids) - 1) for i, c in reversed(list(enumerate(kids))))
        if salt:
            stack.append((f"salt {salt!r}:", "", False))
    while stack and shown < max_nodes:
        node, indent, is_last = stack.pop()
        if isinstance(node, str):  # the header of another salt's tree
            lines.append(node)
            continue
        shown += 1
        label = decode(node.tokens) if decode else " ".join(map(str, node.tokens))
        if len(label) > max_chars:
            label = label[: max_chars - 1] + "…"
        lock = f" lock={node.lock_ref}" if node.lock_ref else ""
        where = f"tier={len(node.host_blocks)}" if node.tiered else f"blocks={len(node.blocks)}"
        lines.append(
            f"{indent}{'└─' if is_last else '├─'} [{node.start}:{node.end}) {label!r} "
            f"{where} hits={node.hits}{lock}"
        )
        kids = ordered_children(node)
        child_indent = indent + ("   " if is_last else "│  ")
        stack.extend(
            (c, child_indent, i == len(kids) - 1) for i, c in reversed(list(enumerate(kids)))
        )
    if shown < cache._num_nodes:
        lines.append(f"… {cache._num_nodes - shown} more nodes")
    return "\n".join(lines)


def ordered_children(node: Any) -> list[Any]:
    """A node's children in a stable order (by first token), for viewers."""
    return sorted(node.children.values(), key=lambda c: c.tokens[0])


def _is_ancestor(up: Any, down: Any) -> bool:
    node = down.parent
    while node is not None:
        if node is up:
            return True
        node = node.parent
    return False


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
