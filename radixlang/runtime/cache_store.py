"""The radix cache on disk: saved at shutdown (or on demand), loaded at the next start.

One file, ``radix-cache.rlkv`` in the cache folder:

    magic (8 bytes) | header length (8, little-endian) | header (JSON) | header CRC-32 (4)
    | each node's KV, in header order

The header names what the KV is only valid for (the *fingerprint*: the model's config and
weight files, the KV dtype and shape, the block size, the tokenizer files) and lists the nodes
parents first: each with its parent's index, its tokens, where its KV lies in the file, its
length in bytes and its CRC-32. A node's KV is K then V for its own positions, ``[layers,
tokens, kv_heads, head_dim]`` each. A save writes a temporary file, flushes it to disk and
renames it over the old one, so a crash mid-save leaves the previous file whole; a file that is
truncated, corrupt or made for another model, dtype, block size or tokenizer is refused with a
message and the engine starts with an empty cache.

Loading rebuilds the tree by inserting every leaf's whole path, least recently used first, so
the most recent prefixes end up in the device pool and older ones are evicted as usual (into the
host tier when there is one, else dropped) when the pool fills.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.kv_cache import KVCache
from radixlang.runtime.radix_cache import RadixCache

FILE_NAME = "radix-cache.rlkv"
MAGIC = b"RLXKV\x00\x01\x00"
FORMAT_VERSION = 1
_FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class CacheFileError(ValueError):
    """A saved cache that cannot be used: says why."""


def fingerprint(model_path: Path, kv: KVCache, weights_dtype: str) -> dict[str, Any]:
    """What a saved cache's KV depends on: the model files, dtypes, shapes and tokenizer."""
    files = {}
    for name in _FINGERPRINT_FILES:
        path = model_path / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    weights = sorted(
        (p.name, p.stat().st_size) for p in model_path.iterdir() if p.suffix == ".safetensors"
    )
    return {
        "format": FORMAT_VERSION,
        "files": files,
        "weights": weights,
        "weights_dtype": weights_dtype,
        "kv_dtype": str(kv.dtype).removeprefix("torch."),
        "block_size": kv.block_size,
        "kv_shape": [kv.shape.num_layers, kv.shape.kv_heads, kv.shape.head_dim],
    }


def save(cache: RadixCache, kv: KVCache, folder: Path, print_: dict[str, Any]) -> dict[str, int]:
    """Write every cached node (device or tiered) to ``folder``; returns nodes, tokens, bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    tier = cache.tier
    nodes: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    offset = 0
    index: dict[int, int] = {}
    for node in cache.nodes_parents_first():
        if node.tiered:
            assert tier is not None
            k, v = tier.gather(node.host_blocks)  # type: ignore[attr-defined]
            blocks = list(range(len(node.host_blocks)))
        else:
            k, v, blocks = kv.k, kv.v, node.blocks
        blob = _node_bytes(k, v, blocks, node.start, node.end, kv.block_size)
        parent = node.parent
        assert parent is not None
        entry = {
            "parent": index.get(parent.id, -1),
            "tokens": list(node.tokens),
            "offset": offset,
            "nbytes": len(blob),
            "crc32": zlib.crc32(blob),
            "last_access": node.last_access,
        }
        if parent.parent is None and (salt := cache.salt_of(parent)):
            entry["salt"] = salt  # a top node under a salted root: its tree's salt
        nodes.append(entry)
        index[node.id] = len(nodes) - 1
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"fingerprint": print_, "nodes": nodes}).encode()
    path = folder / FILE_NAME
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(struct.pack("<I", zlib.crc32(header)))
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    tokens = sum(len(n["tokens"]) for n in nodes)
    return {"nodes": len(nodes), "tokens": tokens, "bytes": path.stat().st_size}


def load(
    cache: RadixCache,
    kv: KVCache,
    folder: Path,
    print_: dict[str, Any],
    write_kv: Callable[[list[int], int, torch.Tensor, torch.Tensor], None] | None = None,
) -> dict[str, int]:
    """Rebuild the cache from ``folder``'s file; raises :class:`CacheFileError` (changing
    nothing) when the file is missing, damaged or made for something else.

    Returns how many nodes and tokens were read and how many tokens ended up cached."""
    path = folder / FILE_NAME
    if not path.is_file():
        raise CacheFileError(f"no saved cache at {path}")
    with open(path, "rb") as f:
        data = f.read()
    head = len(MAGIC) + 8
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise CacheFileError(f"{path} is not a radixlang cache file")
    (header_len,) = struct.unpack("<Q", data[len(MAGIC) : head])
    if len(data) < head + header_len + 4:
        raise CacheFileError(f"{path} is truncated (its header is cut off)")
    header = data[head : head + header_len]
    (crc,) = struct.unpack("<I", data[head + header_len : head + header_len + 4])
    if zlib.crc32(header) != crc:
        raise CacheFileError(f"{path} has a damaged header (checksum mismatch)")
    meta = json.loads(header)
    saved = meta["fingerprint"]
    print_ = json.loads(json.dumps(print_))  # as the file has it (tuples become lists)
    if saved != print_:
        differ = sorted(k for k in set(saved) | set(print_) if saved.get(k) != print_.get(k))
        raise CacheFileError(
            f"{path} was saved for a different setup ({', '.join(differ)} differ): ignored"
        )
    body = memoryview(data)[head + header_len + 4 :]
    nodes = meta["nodes"]
    end = max((n["offset"] + n["nbytes"] for n in nodes), default=0)
    if len(body) != end:
        raise CacheFileError(f"{path} is truncated or has trailing bytes ({len(body)} != {end})")
    for i, n in enumerate(nodes):
        if zlib.crc32(body[n["offset"] : n["offset"] + n["nbytes"]]) != n["crc32"]:
            raise CacheFileError(f"{path}: node {i}'s KV is damaged (checksum mismatch)")
    return _rebuild(cache, kv, nodes, body, write_kv or _writer(kv))


def _rebuild(
    cache: RadixCache,
    kv: KVCache,
    nodes: list[dict[str, Any]],
    body: memoryview,
    write_kv: Callable[[list[int], int, torch.Tensor, torch.Tensor], None],
) -> dict[str, int]:
    pool: BlockPool = cache.pool
    layers, heads, dim = kv.shape.num_layers, kv.shape.kv_heads, kv.shape.head_dim
    has_child = {n["parent"] for n in nodes}
    leaves = [i for i in range(len(nodes)) if i not in has_child]
    leaves.sort(key=lambda i: nodes[i]["last_access"])  # oldest first: the newest stay
    restored = 0
    for leaf in leaves:
        chain = []
        i = leaf
        while i != -1:
            chain.append(i)
            i = nodes[i]["parent"]
        chain.reverse()
        tokens = [t for i in chain for t in nodes[i]["tokens"]]
        need = pool.blocks_for_tokens(len(tokens))
        if need > pool.num_free:
            cache.evict(need - pool.num_free)
        if need > pool.num_free:
            continue  # longer than the pool can hold
        blocks = pool.alloc(need)
        start = 0
        for i in chain:
            n = len(nodes[i]["tokens"])
            raw = torch.frombuffer(
                bytearray(body[nodes[i]["offset"] : nodes[i]["offset"] + nodes[i]["nbytes"]]),
                dtype=torch.uint8,
            )
            k, v = raw.view(kv.dtype).view(2, layers, n, heads, dim)
            write_kv(blocks, start, k, v)
            start += n
        cache.insert(tokens, blocks, nodes[chain[0]].get("salt", ""))
        pool.decref(blocks)
        restored += 1
    return {
        "nodes": len(nodes),
        "tokens": sum(len(n["tokens"]) for n in nodes),
        "paths": restored,
        "cached_tokens": cache.cached_tokens + cache.tiered_tokens,
    }


def _writer(kv: KVCache) -> Callable[[list[int], int, torch.Tensor, torch.Tensor], None]:
    """Write K/V ``[layers, n, heads, dim]`` for positions ``start..start+n`` of a sequence
    whose block table is ``blocks``."""
    bs = kv.block_size

    def write(blocks: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        positions = torch.arange(start, start + n)
        table = torch.tensor(blocks)[positions // bs].to(kv.k.device)
        slots = (positions % bs).to(kv.k.device)
        kv.k[:, table, slots] = k.to(kv.k.device)
        kv.v[:, table, slots] = v.to(kv.v.device)

    return write


def _node_bytes(
    k: torch.Tensor, v: torch.Tensor, blocks: list[int], start: int, end: int, bs: int
) -> bytes:
    """A node's own positions' K then V, from the blocks (by block index) it holds."""
    first = start // bs
    idx = torch.tensor(blocks, device=k.device)
    lo, hi = start - first * bs, end - first * bs
    parts = []
    for t in (k, v):
        rows = t.index_select(1, idx)
        rows = rows.reshape(t.shape[0], len(blocks) * bs, *t.shape[3:])[:, lo:hi]
        parts.append(rows.contiguous().cpu())
    return torch.stack(parts).view(torch.uint8).numpy().tobytes()
