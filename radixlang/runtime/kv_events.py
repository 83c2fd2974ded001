"""KV events: what the radix cache stores and removes, block by block, as a stream a router
(or anyone else) can follow to know what an engine has cached without asking it.

Each full block of a cached sequence is named by a chain hash: the hash of the block's tokens
and the hash of the block before it, so a block's hash names the whole prefix up to its end.
A consumer hashes a prompt the same way (:func:`block_hashes`) and counts how many of its
leading hashes an engine holds: that is the engine's cached prefix, to the block.

The hash is BLAKE2b (8-byte digest, as an unsigned int) over the previous hash (8 bytes,
little-endian) and the block's token ids (4 bytes each, little-endian); the first block's
"previous hash" is the cache salt's seed (:func:`salt_seed`, 0 for no salt). Any language can
compute it.

A block counts as cached while the radix tree holds its tokens, on the device or in the host
tier (a tiered prefix still skips the prefill). Blocks a node only partly fills are not named:
consumers see prefixes to the block, never to the token.

A ``stored`` event also says where its blocks live (``medium``): ``device``, ``host`` (the
host tier: loading them back costs a copy, not a prefill) or ``disk``. A block that moves is
announced as stored again, on its new medium: eviction into the host tier announces ``host``,
loading it back ``device``. A consumer that ignores ``medium`` sees a block stored twice, which
changes nothing for it.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"  # the whole cache was flushed: forget everything before

# Where a stored block lives (``KvEvent.medium``).
DEVICE = "device"
HOST = "host"
DISK = "disk"
MEDIA = (DEVICE, HOST, DISK)


def salt_seed(salt: str) -> int:
    """The chain's starting value for a cache salt: 0 for none, else a hash of its UTF-8."""
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def chain_hash(previous: int, tokens: Sequence[int]) -> int:
    """The hash of one full block after a block whose hash is ``previous``."""
    data = struct.pack("<Q", previous) + array("I", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    salt: str = "",
    first: int = 0,
    previous: int | None = None,
) -> list[int]:
    """The chain hashes of the full blocks of ``tokens`` from block index ``first`` on;
    ``previous`` is block ``first - 1``'s hash (computed from the tokens when not given)."""
    if previous is None:
        previous = salt_seed(salt)
        for i in range(first):
            previous = chain_hash(previous, tokens[i * block_size : (i + 1) * block_size])
    out = []
    for i in range(first, len(tokens) // block_size):
        previous = chain_hash(previous, tokens[i * block_size : (i + 1) * block_size])
        out.append(previous)
    return out


@dataclass(frozen=True)
class KvEvent:
    """One change: ``hashes`` (in prefix order) became cached (``stored``, right after the
    block whose hash is ``parent``; None for a sequence's first block) or left the cache
    (``removed``); or everything was dropped (``cleared``). A stored event's ``medium`` says
    where the blocks are now (one of :data:`MEDIA`)."""

    seq: int  # position in the engine's stream, from 1
    kind: str
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    salt_seed: int = 0
    medium: str = DEVICE

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "seq": self.seq,
            "kind": self.kind,
            "hashes": list(self.hashes),
            "parent": self.parent,
            "salt_seed": self.salt_seed,
        }
        if self.kind == STORED:
            out["medium"] = self.medium
        return out


class KvEventLog:
    """The latest events, numbered. Appended on the engine thread, read from any thread; a
    reader that fell more than ``capacity`` events behind is told so (``gap``) and must take a
    fresh snapshot of the cache instead."""

    def __init__(self, capacity: int = 65536) -> None:
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._next = 1

    @property
    def last_seq(self) -> int:
        """The number of the newest event (0 before the first)."""
        return self._next - 1

    def append(
        self,
        kind: str,
        hashes: Sequence[int] = (),
        parent: int | None = None,
        seed: int = 0,
        medium: str = DEVICE,
    ) -> None:
        with self._lock:
            self._events.append(KvEvent(self._next, kind, tuple(hashes), parent, seed, medium))
            self._next += 1

    def since(self, seq: int) -> tuple[list[KvEvent], bool]:
        """The events after number ``seq``, and whether some of them were already dropped."""
        with self._lock:
            if not self._events or seq >= self._next - 1:
                return [], False
            oldest = self._events[0].seq
            gap = seq + 1 < oldest
            skip = max(0, seq + 1 - oldest)
            return [self._events[i] for i in range(skip, len(self._events))], gap


# ---- naming a radix tree's blocks (the tree's nodes: ``tokens``, ``start``, ``end``,
# ``parent``, ``children``, ``hashes``, ``tiered``; runtime/radix_cache.py) -----------------------
def node_medium(node: Any) -> str:
    """Where a tree node's KV is: in the host tier (``tiered``) or on the device."""
    return HOST if node.tiered else DEVICE


def name_node_blocks(
    log: KvEventLog, node: Any, seed: int, block_size: int, key: list[int] | None = None
) -> None:
    """Hash ``node``'s full blocks (``key``: the tokens from the root to at least its end),
    keep the hashes on the node and announce them as stored."""
    first, stop = node.start // block_size, node.end // block_size
    if first == stop:
        return
    if key is None:
        key = path_tokens(node)
    previous = hash_on_path(node.parent, first - 1, seed, block_size)
    node.hashes = block_hashes(key[: stop * block_size], block_size, first=first,
                               previous=previous)  # fmt: skip
    log.append(STORED, node.hashes, previous if first else None, seed, node_medium(node))


def announce_moved_blocks(log: KvEventLog, node: Any, seed: int, block_size: int) -> None:
    """``node`` moved between the device and a tier: announce its named blocks as stored
    again (the same hashes and parent), on the medium they are on now."""
    if not node.hashes:
        return
    first = node.start // block_size
    parent = hash_on_path(node.parent, first - 1, seed, block_size) if first else None
    log.append(STORED, node.hashes, parent, seed, node_medium(node))


def hash_on_path(node: Any, index: int, seed: int, block_size: int) -> int:
    """The hash of block ``index`` on the path ending at ``node`` (``seed`` before block 0)."""
    if index < 0:
        return seed
    while node is not None and node.parent is not None:
        first = node.start // block_size
        if first <= index < first + len(node.hashes):
            return node.hashes[index - first]
        node = node.parent
    raise AssertionError(f"block {index} has no hash on the path")


def path_tokens(node: Any) -> list[int]:
    """The tokens from the root to the end of ``node``."""
    parts = []
    while node is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def tree_block_hashes(roots: Sequence[tuple[str, Any]]) -> list[tuple[int, list[int]]]:
    """Every named block under each salt's root, as (salt seed, hashes) per node."""
    return [(seed, hashes) for seed, hashes, _ in tree_block_media(roots)]


def tree_block_media(roots: Sequence[tuple[str, Any]]) -> list[tuple[int, list[int], str]]:
    """Every named block under each salt's root, as (salt seed, hashes, medium) per node."""
    out = []
    for salt, root in roots:
        seed = salt_seed(salt)
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.hashes:
                out.append((seed, list(node.hashes), node_medium(node)))
    return out
