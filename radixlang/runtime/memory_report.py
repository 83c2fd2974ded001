"""Where the KV memory goes: one snapshot of the block pool, the radix tree and the running
requests, as numbers (``to_dict``), a short table (``render_text``) and a figure (``save_png``).

Read the three together where nothing mutates them (the engine thread: ``Engine.memory_report``
calls :func:`collect_memory_report` through ``Engine._call``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import RadixCache

if TYPE_CHECKING:
    from radixlang.runtime.kv_cache import KVCache
    from radixlang.runtime.request import Req

# Host bookkeeping sizes (CPython, 64-bit): a list's header and its per-item pointer, an int
# object. Ints may be shared between lists (a block id in a node's and a request's table), so
# counting one object per item makes the metadata estimate an upper bound.
_LIST_BYTES = sys.getsizeof([])
_POINTER_BYTES = 8
_INT_BYTES = sys.getsizeof(1 << 20)


@dataclass(frozen=True)
class MemoryReport:
    """KV memory at one moment.

    Blocks: every used block is held by the tree only, by running requests only, by both, or
    (``blocks_unaccounted``, 0 unless something else holds blocks) by neither; ``blocks_shared``
    counts blocks with more than one reference.

    Slots: ``slots_allocated`` is used blocks × block size; ``tokens_live`` counts the slots
    with valid KV: for each used block, the highest valid slot over all its holders (a tree node
    holding block index ``i`` of positions ``[start, end)`` makes ``min(end, (i+1)*bs) - i*bs``
    slots valid, a running request ``min(num_computed, (i+1)*bs) - i*bs``); blocks a request
    holds for tokens it has not computed yet are allocated, not live.

    Sharing: ``logical_tokens`` is what the sequences would take without sharing: the sum over
    running requests of ``num_computed`` plus, for each cached tree leaf (a node without
    children) that no running request is on (unlocked), its full path length (``node.end``).
    A locked leaf is part of a running request's own sequence, counted with that request. With
    a host tier, a node whose KV lives on the tier (no device blocks) holds nothing here, so
    "leaves" are the device nodes without a device child (``tree_host_nodes`` counts the
    others). ``sharing`` is logical tokens / live tokens.

    Metadata: ``metadata_bytes`` estimates the host-side bookkeeping (tree nodes with their
    token, block and child containers, the pool's reference counts and free list, the running
    requests' block tables), counting one int object per stored id (an upper bound).

    ``tier`` is the host tier's own ``stats()`` dict, or None when the cache has no tier.
    """

    block_size: int
    bytes_per_block: int  # 0 when the KV storage is not known (a pool without a KVCache)
    blocks_total: int
    blocks_free: int
    blocks_used: int
    blocks_tree_only: int
    blocks_requests_only: int
    blocks_both: int
    blocks_unaccounted: int
    blocks_shared: int
    blocks_evictable: int
    slots_allocated: int
    tokens_live: int
    logical_tokens: int
    running_requests: int
    tree_nodes: int
    tree_leaves: int
    metadata_bytes: int
    tree_host_nodes: int = 0  # nodes whose KV is on the host tier (no device blocks)
    kv_dtype: str | None = None
    tier: dict[str, Any] | None = None

    # ---- derived figures ---------------------------------------------------------------
    @property
    def fragmentation(self) -> float:
        """Allocated slots without valid KV, as a fraction of the allocated ones."""
        if not self.slots_allocated:
            return 0.0
        return 1.0 - self.tokens_live / self.slots_allocated

    @property
    def allocated_per_live(self) -> float | None:
        """Allocated slots per live token; None while nothing is live."""
        return self.slots_allocated / self.tokens_live if self.tokens_live else None

    @property
    def sharing(self) -> float | None:
        """Logical tokens per live (physical) token; None while nothing is live."""
        return self.logical_tokens / self.tokens_live if self.tokens_live else None

    @property
    def kv_bytes(self) -> int:
        """Bytes of the whole device KV pool (0 when the storage is not known)."""
        return self.blocks_total * self.bytes_per_block

    @property
    def metadata_fraction(self) -> float | None:
        """Host bookkeeping bytes per KV byte; None when the KV bytes are not known."""
        return self.metadata_bytes / self.kv_bytes if self.kv_bytes else None

    # ---- output --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, grouped; :meth:`from_dict` reads it back."""
        return {
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_dtype": self.kv_dtype,
            "blocks": {
                "total": self.blocks_total,
                "free": self.blocks_free,
                "used": self.blocks_used,
                "tree_only": self.blocks_tree_only,
                "requests_only": self.blocks_requests_only,
                "both": self.blocks_both,
                "unaccounted": self.blocks_unaccounted,
                "shared": self.blocks_shared,
                "evictable": self.blocks_evictable,
            },
            "slots": {
                "allocated": self.slots_allocated,
                "live": self.tokens_live,
                "fragmentation": self.fragmentation,
                "allocated_per_live": self.allocated_per_live,
            },
            "sharing": {
                "logical_tokens": self.logical_tokens,
                "live_tokens": self.tokens_live,
                "ratio": self.sharing,
            },
            "running_requests": self.running_requests,
            "tree": {
                "nodes": self.tree_nodes,
                "leaves": self.tree_leaves,
                "host_nodes": self.tree_host_nodes,
            },
            "kv_bytes": {
                "total": self.kv_bytes,
                "used": self.blocks_used * self.bytes_per_block,
                "live": self.tokens_live * self.bytes_per_block // self.block_size,
            },
            "metadata": {"bytes": self.metadata_bytes, "fraction_of_kv": self.metadata_fraction},
            "tier": self.tier,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryReport:
        """The report :meth:`to_dict` wrote (e.g. a server's ``/memory``)."""
        b, s = d["blocks"], d["slots"]
        return cls(
            block_size=d["block_size"],
            bytes_per_block=d["bytes_per_block"],
            blocks_total=b["total"],
            blocks_free=b["free"],
            blocks_used=b["used"],
            blocks_tree_only=b["tree_only"],
            blocks_requests_only=b["requests_only"],
            blocks_both=b["both"],
            blocks_unaccounted=b["unaccounted"],
            blocks_shared=b["shared"],
            blocks_evictable=b["evictable"],
            slots_allocated=s["allocated"],
            tokens_live=s["live"],
            logical_tokens=d["sharing"]["logical_tokens"],
            running_requests=d["running_requests"],
            tree_nodes=d["tree"]["nodes"],
            tree_leaves=d["tree"]["leaves"],
            metadata_bytes=d["metadata"]["bytes"],
            tree_host_nodes=d["tree"].get("host_nodes", 0),
            kv_dtype=d.get("kv_dtype"),
            tier=d.get("tier"),
        )

    def render_text(self) -> str:
        """A short human-readable table."""
        bs = self.block_size
        size = f", {_bytes(self.bytes_per_block)} per block ({_bytes(self.kv_bytes)})"
        dtype = f", {self.kv_dtype}" if self.kv_dtype else ""
        used_pct = self.blocks_used / self.blocks_total if self.blocks_total else 0.0
        per_live = self.allocated_per_live
        sharing = self.sharing
        fraction = self.metadata_fraction
        lines = [
            f"KV memory: {self.blocks_total} blocks x {bs} tokens"
            + (size if self.bytes_per_block else "")
            + dtype,
            f"blocks    used {self.blocks_used}/{self.blocks_total} ({used_pct:.1%}), "
            f"free {self.blocks_free}",
            f"          tree only {self.blocks_tree_only}, requests only "
            f"{self.blocks_requests_only}, both {self.blocks_both}"
            + (f", unaccounted {self.blocks_unaccounted}" if self.blocks_unaccounted else "")
            + f"; shared (refcount > 1) {self.blocks_shared}; evictable {self.blocks_evictable}",
            f"slots     {self.tokens_live} live of {self.slots_allocated} allocated: "
            f"fragmentation {self.fragmentation:.1%}, "
            + (f"{per_live:.2f} allocated per live" if per_live is not None else "nothing live"),
            f"sharing   {self.logical_tokens} logical tokens on {self.tokens_live} live: "
            + (f"{sharing:.2f}x" if sharing is not None else "-")
            + f" ({self.running_requests} running requests, {self.tree_leaves} tree leaves, "
            f"{self.tree_nodes} nodes"
            + (f", {self.tree_host_nodes} on the host tier" if self.tree_host_nodes else "")
            + ")",
            f"metadata  ~{_bytes(self.metadata_bytes)} host bookkeeping"
            + (f" ({fraction:.3%} of the KV bytes)" if fraction is not None else ""),
            f"tier      {_tier_text(self.tier)}",
        ]
        return "\n".join(lines)

    def save_png(self, path: str | Path) -> Path:
        """Draw the blocks, the slots and the host tier as stacked bars into a PNG at ``path``."""
        from matplotlib.figure import Figure  # no pyplot: no global backend state

        path = Path(path)
        # Each row: (name, [(part, count, colour)], the count that fills the bar). The first
        # row is the whole pool; the next two zoom in on the used blocks, the fourth on the
        # allocated slots, so that a nearly empty pool still shows where its memory goes.
        holders = [
            ("tree only", self.blocks_tree_only, "#4c72b0"),
            ("tree + requests", self.blocks_both, "#8172b3"),
            ("requests only", self.blocks_requests_only, "#dd8452"),
            ("unaccounted", max(0, self.blocks_unaccounted), "#c44e52"),
        ]
        used = self.blocks_used
        rows: list[tuple[str, list[tuple[str, int, str]], int]] = [
            ("device blocks", [*holders, ("free", self.blocks_free, "#dddddd")], self.blocks_total),
            ("used blocks\nby holder", holders, used),
            (
                "used blocks\nby references",
                [
                    ("shared (refcount > 1)", self.blocks_shared, "#937860"),
                    ("one holder", max(0, used - self.blocks_shared), "#b8b8b8"),
                ],
                used,
            ),
            (
                "allocated slots",
                [
                    ("live", self.tokens_live, "#55a868"),
                    ("allocated, not live", self.slots_allocated - self.tokens_live, "#ccb974"),
                ],
                self.slots_allocated,
            ),
        ]
        tier = self.tier or {}
        if isinstance(tier.get("blocks_total"), int) and isinstance(tier.get("blocks_used"), int):
            tier_used, tier_total = tier["blocks_used"], tier["blocks_total"]
            tier_free = max(0, tier_total - tier_used)
            rows.append(
                (
                    "host tier blocks",
                    [("tier used", tier_used, "#64b5cd"), ("free", tier_free, "#dddddd")],
                    tier_total,
                )
            )
        fig = Figure(figsize=(9, 1.4 + 0.7 * len(rows)), layout="constrained")
        ax = fig.add_subplot()
        labelled: set[str] = set()
        for y, (_, parts, total) in enumerate(rows):
            left = 0.0
            for label, count, color in parts:
                width = count / total if total else 0.0
                legend = label if label not in labelled and count else "_nolegend_"
                labelled.add(legend)
                ax.barh(y, width, left=left, color=color, edgecolor="white", label=legend)
                if width > 0.06:  # room for the count inside the segment
                    ax.text(left + width / 2, y, str(count), ha="center", va="center", fontsize=8)
                left += width
        ax.set_yticks(range(len(rows)), [f"{name}\n({total})" for name, _, total in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the row's total (in brackets)")
        sharing = self.sharing
        ax.set_title(
            f"KV memory: {self.blocks_used}/{self.blocks_total} blocks used, "
            f"fragmentation {self.fragmentation:.1%}, sharing "
            + (f"{sharing:.2f}x" if sharing is not None else "-")
            + f", {self.blocks_shared} shared blocks, metadata ~{_bytes(self.metadata_bytes)}",
            fontsize=9,
        )
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)), ncol=4, fontsize=8
        )
        fig.savefig(path, dpi=100)
        return path


def collect_memory_report(
    pool: BlockPool,
    cache: RadixCache,
    running: Iterable[Req],
    kv: KVCache | None = None,
) -> MemoryReport:
    """Snapshot ``pool``, ``cache`` and the ``running`` requests (``.blocks``, ``.num_computed``);
    ``kv`` gives the bytes per block. See :class:`MemoryReport` for what each figure means."""
    bs = pool.block_size
    valid: dict[int, int] = {}  # held block -> its highest valid slot count over all holders
    tree_blocks: set[int] = set()
    logical = nodes = leaves = host_nodes = 0
    metadata = _node_bytes(cache.root)
    # Every salt's tree: the nodes right under a root.
    stack = [n for n in cache.nodes_parents_first() if n.parent is None or n.parent.parent is None]
    while stack:
        node = stack.pop()
        nodes += 1
        metadata += _node_bytes(node)
        children = list(getattr(node, "children", {}).values())
        stack.extend(children)
        blocks = _device_blocks(node)
        if not blocks:  # its KV lives on the host tier: nothing on the device
            host_nodes += 1
            continue
        end = node.end
        first = node.start // bs
        for j, b in enumerate(blocks):
            i = first + j
            _note_valid(valid, b, min(end, (i + 1) * bs) - i * bs)
        tree_blocks.update(blocks)
        if not any(_device_blocks(child) for child in children):  # a leaf on the device
            leaves += 1
            if not node.lock_ref:  # else a running request's own tokens, counted with it
                logical += end
    request_blocks: set[int] = set()
    num_running = 0
    for req in running:
        num_running += 1
        computed = req.num_computed
        for i, b in enumerate(req.blocks):
            if b < 0:  # released before a sliding window (block_pool.RELEASED): holds nothing
                continue
            _note_valid(valid, b, max(0, min(computed, (i + 1) * bs) - i * bs))
            request_blocks.add(b)
        logical += computed
        metadata += _ids_bytes(len(req.blocks), sys.getsizeof(req.blocks))
    held = tree_blocks | request_blocks
    # The pool's reference counts (small ints, interned) and its free list of block ids.
    metadata += _LIST_BYTES + _POINTER_BYTES * pool.num_blocks
    metadata += _ids_bytes(pool.num_free)
    tier = getattr(cache, "tier", None)
    return MemoryReport(
        block_size=bs,
        bytes_per_block=kv.num_bytes // kv.num_blocks if kv is not None else 0,
        blocks_total=pool.num_blocks,
        blocks_free=pool.num_free,
        blocks_used=pool.num_used,
        blocks_tree_only=len(tree_blocks - request_blocks),
        blocks_requests_only=len(request_blocks - tree_blocks),
        blocks_both=len(tree_blocks & request_blocks),
        blocks_unaccounted=pool.num_used - len(held),
        blocks_shared=sum(1 for b in held if pool.refcount(b) > 1),
        blocks_evictable=cache.evictable_size(),
        slots_allocated=pool.num_used * bs,
        tokens_live=sum(valid.values()),
        logical_tokens=logical,
        running_requests=num_running,
        tree_nodes=nodes,
        tree_leaves=leaves,
        metadata_bytes=metadata,
        tree_host_nodes=host_nodes,
        kv_dtype=str(kv.dtype).removeprefix("torch.") if kv is not None else None,
        tier=dict(tier.stats()) if tier is not None else None,
    )


def _device_blocks(node: Any) -> list[int]:
    return getattr(node, "blocks", None) or []


def _note_valid(valid: dict[int, int], block: int, slots: int) -> None:
    if slots > valid.get(block, -1):
        valid[block] = slots


def _ids_bytes(n: int, container: int | None = None) -> int:
    """A list of ``n`` ids: the list itself (its real size when known) and one int per id."""
    return (container if container is not None else _LIST_BYTES + _POINTER_BYTES * n) + (
        _INT_BYTES * n
    )


def _node_bytes(node: Any) -> int:
    """A tree node's object and its containers (tokens, device and host blocks, children)."""
    total = sys.getsizeof(node)
    for name in ("tokens", "blocks", "host_blocks"):
        ids = getattr(node, name, None)
        if ids is not None:
            total += _ids_bytes(len(ids), sys.getsizeof(ids))
    children = getattr(node, "children", None)
    if children is not None:
        total += sys.getsizeof(children)
    return total


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _tier_text(tier: Mapping[str, Any] | None) -> str:
    if tier is None:
        return "off"
    parts = []
    if "blocks_used" in tier and "blocks_total" in tier:
        parts.append(f"{tier['blocks_used']}/{tier['blocks_total']} blocks")
    if "bytes_used" in tier and "bytes_total" in tier:
        parts.append(f"{_bytes(tier['bytes_used'])}/{_bytes(tier['bytes_total'])}")
    elif "bytes_used" in tier:
        parts.append(_bytes(tier["bytes_used"]))
    if "nodes" in tier:
        parts.append(f"{tier['nodes']} nodes")
    return ", ".join(parts) if parts else "on"
