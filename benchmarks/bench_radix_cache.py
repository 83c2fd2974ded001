"""Radix cache throughput and eviction scaling.

One command:  .venv/bin/python benchmarks/bench_radix_cache.py
Writes benchmarks/results/bench_radix_cache.json and .png.

1. Throughput on a workload with heavy prefix sharing (default 100k sequences): each sequence is
   one of 64 system prompts (256 tokens), one of 4,096 documents under it (64 tokens), and a
   unique question (16-48 tokens). Measured: insert, match (n/2 exact hits, then n/2 partial
   hits that end at a random point and split a node there) and evict(1) operations per
   second, each primitive timed on its own.
2. Cost per evicted leaf at 1k, 10k and 100k leaves, against a baseline run side by side that
   finds the LRU leaf by scanning the whole tree on every eviction (what a cache without an
   eviction heap does). The ratio of costs at 100k vs 1k leaves is the scaling figure: near 1 for
   a logarithmic eviction, near 100 for a linear one.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import time
from pathlib import Path

from provenance import provenance

from radixlang.runtime import BlockPool, RadixCache

VOCAB = 49152
BLOCK_SIZE = 16


def make_workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(256)] for _ in range(64)]
    docs = [
        (rng.randrange(len(systems)), [rng.randrange(VOCAB) for _ in range(64)])
        for _ in range(4096)
    ]
    seqs = []
    for _ in range(n):
        sys_id, doc = docs[rng.randrange(len(docs))]
        question = [rng.randrange(VOCAB) for _ in range(rng.randint(16, 48))]
        seqs.append(systems[sys_id] + doc + question)
    return seqs


def fill(cache: RadixCache, seqs: list[list[int]]) -> float:
    """Insert every sequence as a request would (alloc its blocks, insert, release); returns the
    seconds spent inside insert()."""
    pool = cache.pool
    spent = 0.0
    for seq in seqs:
        blocks = pool.alloc(pool.blocks_for_tokens(len(seq)))
        t = time.perf_counter()
        cache.insert(seq, blocks)
        spent += time.perf_counter() - t
        pool.decref(blocks)
    return spent


def throughput(n: int, seed: int) -> dict:
    seqs = make_workload(n, seed)
    total_tokens = sum(map(len, seqs))
    pool = BlockPool(pool_blocks_for(seqs), BLOCK_SIZE)
    cache = RadixCache(pool)
    insert_s = fill(cache, seqs)
    nodes_after_insert = cache.num_nodes
    rng = random.Random(seed + 1)
    exact = [seqs[rng.randrange(n)] for _ in range(n // 2)]
    # A partial hit ends at a random point and then diverges: the match splits a node there.
    partial = [[*s[: rng.randint(1, len(s))], VOCAB + 1] for s in exact]
    match_rates = {}
    for name, queries in (("exact", exact), ("partial", partial)):
        t = time.perf_counter()
        hit = sum(cache.match_prefix(q).length for q in queries)
        seconds = time.perf_counter() - t
        match_rates[f"match_{name}_ops_per_s"] = len(queries) / seconds
        match_rates[f"match_{name}_hit_tokens_per_s"] = hit / seconds
    cache.check_integrity()
    nodes = cache.num_nodes
    cached_tokens = cache.cached_tokens
    evictions = 0
    t = time.perf_counter()
    while cache.evict(1):
        evictions += 1
    evict_s = time.perf_counter() - t
    cache.check_integrity({})
    return {
        "sequences": n,
        "tokens": total_tokens,
        "tree_nodes": nodes_after_insert,
        "tree_tokens": cached_tokens,
        "sharing_factor": total_tokens / cached_tokens,
        "insert_ops_per_s": n / insert_s,
        "insert_tokens_per_s": total_tokens / insert_s,
        **match_rates,
        "tree_nodes_after_matches": nodes,
        "evict_calls": evictions,
        "evict_ops_per_s": evictions / evict_s,
        "all_blocks_free_after": pool.num_free == pool.num_blocks,
    }


def pool_blocks_for(seqs: list[list[int]]) -> int:
    return sum(-(-len(s) // BLOCK_SIZE) for s in seqs) + 16


class ScanEvictionCache(RadixCache):
    """Baseline: finds the least recently used unlocked leaf by walking the whole tree."""

    def evict(self, num_blocks: int) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_blocks:
            best = None
            stack = list(self.root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node.lock_ref == 0 and (best is None or node.last_access < best.last_access):
                    best = node
            if best is None:
                break
            freed.extend(self._remove_leaf(best))
        return freed


def eviction_cost(cache_cls: type[RadixCache], leaves: int, evictions: int, seed: int) -> dict:
    seqs = make_workload(leaves, seed)
    cache = cache_cls(BlockPool(pool_blocks_for(seqs), BLOCK_SIZE))
    fill(cache, seqs)
    rng = random.Random(seed + 2)
    for _ in range(leaves):  # scramble recency so that LRU order is not insertion order
        cache.match_prefix(seqs[rng.randrange(leaves)])
    n_leaves = len(cache._candidates)
    t = time.perf_counter()
    done = 0
    for _ in range(evictions):
        if not cache.evict(1):
            break
        done += 1
    seconds = time.perf_counter() - t
    return {
        "leaves": n_leaves,
        "evictions": done,
        "us_per_evicted_leaf": seconds / done * 1e6,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("heap", "radixlang (LRU heap)"), ("scan", "baseline (scan per evict)")):
        rows = result["eviction_scaling"][name]
        ax.plot(
            [r["leaves"] for r in rows], [r["us_per_evicted_leaf"] for r in rows], "o-", label=label
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("unlocked leaves in the tree")
    ax.set_ylabel("µs per evicted leaf")
    ax.set_title("Radix cache: cost of one LRU eviction")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=100_000)
    parser.add_argument("--leaves", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--evictions", type=int, default=1_000)
    parser.add_argument(
        "--baseline-budget",
        type=int,
        default=3_000_000,
        help="max leaves x evictions the scanning baseline may visit per size",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    result: dict = {
        "benchmark": "bench_radix_cache",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "provenance": provenance(argv),
        "block_size": BLOCK_SIZE,
    }
    print(f"throughput on {args.sequences} sequences ...", flush=True)
    result["throughput"] = throughput(args.sequences, args.seed)
    print(json.dumps(result["throughput"], indent=2), flush=True)
    scaling: dict[str, list[dict]] = {"heap": [], "scan": []}
    for leaves in args.leaves:
        heap = eviction_cost(RadixCache, leaves, min(args.evictions, leaves), args.seed)
        scan_evictions = max(10, min(args.evictions, leaves, args.baseline_budget // leaves))
        scan = eviction_cost(ScanEvictionCache, leaves, scan_evictions, args.seed)
        scaling["heap"].append(heap)
        scaling["scan"].append(scan)
        print(
            f"{leaves:>7} leaves: heap {heap['us_per_evicted_leaf']:8.2f} us/leaf, "
            f"scan {scan['us_per_evicted_leaf']:10.2f} us/leaf",
            flush=True,
        )
    result["eviction_scaling"] = scaling
    first, last = scaling["heap"][0], scaling["heap"][-1]
    result["summary"] = {
        "leaf_growth": last["leaves"] / first["leaves"],
        "heap_cost_growth": last["us_per_evicted_leaf"] / first["us_per_evicted_leaf"],
        "scan_cost_growth": scaling["scan"][-1]["us_per_evicted_leaf"]
        / scaling["scan"][0]["us_per_evicted_leaf"],
        "scan_over_heap_at_largest": scaling["scan"][-1]["us_per_evicted_leaf"]
        / last["us_per_evicted_leaf"],
    }
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result["summary"], indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_radix_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "bench_radix_cache.png")
    print(f"wrote {args.out / 'bench_radix_cache.json'} and .png")
    return result


if __name__ == "__main__":
    main()
