"""Prefix sharing on the default model's real tokens: a radix cache over a paged block pool.

Loads the default model's files (converting its GGUF once), tokenizes a small set of LLM-program
prompts with the model's chat template (one system prompt; multi-turn chats whose turns extend
each other; a question forked into several branches), and runs them as requests through the
block pool and the radix cache: reuse the cached prefix, copy its partial last block on write,
allocate blocks for the rest, insert, release. No forward pass runs yet (that arrives with the
model runner); the numbers are what the cache saves: tokens not recomputed, blocks not stored.

    .venv/bin/python examples/prefix_cache_demo.py [--model NAME_OR_PATH] [--kv-budget-mib N]
"""

from __future__ import annotations

import argparse

from radixlang.models import DEFAULT_MODEL, load_model_files
from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import RadixCache

SYSTEM = (
    "You are a careful assistant inside a radixlang program. Answer in one short paragraph, "
    "state your assumptions, and say when you are unsure."
)
CHATS = [
    [
        "What is a radix tree?",
        "How does it differ from a trie?",
        "Where is it used in LLM serving?",
    ],
    ["Explain KV caching in one paragraph.", "Why does paging help?"],
    ["Give me three names for a cat.", "Now three for a dog."],
]
FORKED_QUESTION = "Is 221 a prime number? Think step by step."
BRANCH_OPENINGS = ["First, ", "Let us try small factors: ", "Check divisibility by 13: "]


def build_requests(tokenizer) -> list[tuple[str, list[int]]]:
    """The prompts a multi-turn + fork program would send, in order, as token ids."""

    def encode(messages: list[dict], suffix: str = "") -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text + suffix, add_special_tokens=False)["input_ids"]

    requests = []
    for c, turns in enumerate(CHATS):
        messages = [{"role": "system", "content": SYSTEM}]
        for t, question in enumerate(turns):
            messages.append({"role": "user", "content": question})
            requests.append((f"chat {c} turn {t}", encode(messages)))
            messages.append({"role": "assistant", "content": f"(answer {c}.{t})"})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FORKED_QUESTION}]
    for b, opening in enumerate(BRANCH_OPENINGS):
        requests.append((f"fork branch {b}", encode(messages, opening)))
    return requests


def run_request(cache: RadixCache, tokens: list[int]) -> int:
    """One request's life in the memory core; returns how many tokens it reused."""
    pool = cache.pool
    match = cache.match_prefix(tokens)
    cache.lock(match.handle)  # keep our prefix while we allocate (eviction may run)
    pool.incref(match.blocks)
    blocks = list(match.blocks)
    partial = match.length % pool.block_size
    new_blocks = pool.blocks_for_tokens(len(tokens)) - len(blocks) + (1 if partial else 0)
    if new_blocks > pool.num_free:
        cache.evict(new_blocks - pool.num_free)
    if partial:  # the last reused block is shared: copy its valid slots before appending
        blocks[-1] = pool.copy_on_write(blocks[-1], partial)
    blocks += pool.alloc(pool.blocks_for_tokens(len(tokens)) - len(blocks))
    # ... the model would compute KV for tokens[match.length:] into `blocks` here ...
    cache.insert(tokens, blocks)
    cache.unlock(match.handle)
    pool.decref(blocks)  # the request finishes; the tree keeps what it adopted
    return match.length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-budget-mib", type=float, default=64.0)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    files = load_model_files(args.model)
    c = files.config
    print(f"model      {files.name}  ({files.path})")
    print(
        f"           {c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_heads} query / {c.num_kv_heads} KV heads of {c.head_dim}, "
        f"vocab {c.vocab_size}, context {c.max_context}, rope theta {c.rope_theta:g}"
    )
    per_token = c.kv_bytes_per_token(2)
    num_blocks = int(args.kv_budget_mib * 2**20 // (per_token * args.block_size))
    print(
        f"KV cache   {per_token / 1024:.1f} KiB per token in bfloat16; a {args.kv_budget_mib:g} "
        f"MiB budget holds {num_blocks} blocks of {args.block_size} tokens"
    )

    tokenizer = files.load_tokenizer()
    cache = RadixCache(BlockPool(num_blocks, args.block_size))
    requests = build_requests(tokenizer)
    total = reused = 0
    print(f"\n{'request':<16}{'tokens':>8}{'reused':>8}{'computed':>10}")
    for name, tokens in requests:
        hit = run_request(cache, tokens)
        total += len(tokens)
        reused += hit
        print(f"{name:<16}{len(tokens):>8}{hit:>8}{len(tokens) - hit:>10}")
        cache.check_integrity({})

    unshared_blocks = sum(cache.pool.blocks_for_tokens(len(t)) for _, t in requests)
    print(
        f"\n{len(requests)} requests, {total} prompt tokens: {reused} reused from the cache "
        f"({reused / total:.1%}), {total - reused} computed"
    )
    print(f"blocks held by the cache: {cache.pool.num_used} (without sharing: {unshared_blocks})")
    print()
    print(cache.render(decode=tokenizer.decode, max_chars=40))
    cache.flush()
    cache.check_integrity({})
    assert cache.pool.num_free == cache.pool.num_blocks
    print("\nflushed: every block is free again")


if __name__ == "__main__":
    main()
