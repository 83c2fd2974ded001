"""Prefix sharing on the default model: a radix cache over a paged KV block pool, run for real.

Loads the default model (converting its GGUF once), tokenizes a small set of LLM-program prompts
with the model's chat template (one system prompt; multi-turn chats whose turns extend each
other; a question forked into several branches), and runs them one after another through the
block pool, the radix cache and the native model runner: reuse the cached prefix, copy its
partial last block on write, compute only the rest of the prompt, greedy-decode a few tokens,
insert the sequence, release. It prints the tokens reused vs computed, the blocks stored with and
without sharing, the tree, and checks that a reply computed over a reused prefix has the same
logits as one computed from scratch.

    .venv/bin/python examples/prefix_cache_demo.py [--model NAME_OR_PATH] [--kv-budget-mib N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime import BlockPool, ModelRunner, RadixCache, SequenceInput

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


def run_program(tokenizer, ask: Callable[[str, list[int]], str]) -> None:
    """The prompts a multi-turn + fork program sends, in order: ``ask(name, tokens)`` returns
    the model's reply, which the next turn of a chat carries in its history."""

    def encode(messages: list[dict], suffix: str = "") -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text + suffix, add_special_tokens=False)["input_ids"]

    for c, turns in enumerate(CHATS):
        messages = [{"role": "system", "content": SYSTEM}]
        for t, question in enumerate(turns):
            messages.append({"role": "user", "content": question})
            reply = ask(f"chat {c} turn {t}", encode(messages))
            messages.append({"role": "assistant", "content": reply})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FORKED_QUESTION}]
    for b, opening in enumerate(BRANCH_OPENINGS):
        ask(f"fork branch {b}", encode(messages, opening))


def reserve(cache: RadixCache, n: int) -> list[int]:
    """``n`` fresh blocks, evicting least-recently-used cached sequences if the pool is full."""
    pool = cache.pool
    if n > pool.num_free:
        cache.evict(n - pool.num_free)
    return pool.alloc(n)


def run_request(
    cache: RadixCache, runner: ModelRunner, tokens: list[int], new_tokens: int
) -> tuple[int, list[int], torch.Tensor]:
    """One request's life: reuse, compute the rest, decode greedily, insert, release.

    Returns how many prompt tokens it reused, the tokens it generated, and the logits that
    chose the first of them.
    """
    pool = cache.pool
    match = cache.match_prefix(tokens)
    cache.lock(match.handle)  # keep our prefix while we allocate (eviction may run)
    pool.incref(match.blocks)
    blocks = list(match.blocks)
    partial = match.length % pool.block_size
    if partial:  # the last reused block is shared: copy its valid slots before appending
        blocks[-1] = pool.copy_on_write(blocks[-1], partial)
    blocks += reserve(cache, pool.blocks_for_tokens(len(tokens)) - len(blocks))
    out = runner.forward([SequenceInput(tokens[match.length :], match.length, blocks)])
    first_logits = out.logits[0]
    sequence = list(tokens)
    generated = [int(first_logits.argmax())]
    while len(generated) < new_tokens and generated[-1] not in runner.files.config.eos_token_ids:
        sequence.append(generated[-1])
        if len(sequence) > len(blocks) * pool.block_size:
            blocks += reserve(cache, 1)
        out = runner.forward([SequenceInput(sequence[-1:], len(sequence) - 1, blocks)])
        generated.append(int(out.logits[0].argmax()))
    cache.insert(sequence, blocks)  # every token whose K/V is now stored
    cache.unlock(match.handle)
    pool.decref(blocks)  # the request finishes; the tree keeps what it adopted
    return match.length, generated, first_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-budget-mib", type=float, default=64.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per request")
    args = parser.parse_args()

    files = load_model_files(args.model)
    c = files.config
    print(f"model      {files.name}  ({files.path})")
    print(
        f"           {c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_heads} query / {c.num_kv_heads} KV heads of {c.head_dim}, "
        f"vocab {c.vocab_size}, context {c.max_context}, rope theta {c.rope_theta:g}"
    )
    budget = int(args.kv_budget_mib * 2**20)
    runner = ModelRunner(files, kv_budget_bytes=budget, block_size=args.block_size)
    kv = runner.kv.describe()
    print(
        f"KV cache   {kv['bytes_per_token'] / 1024:.1f} KiB per token in {kv['dtype']}; a "
        f"{args.kv_budget_mib:g} MiB budget holds {kv['num_blocks']} blocks of "
        f"{kv['block_size']} tokens"
    )

    tokenizer = files.load_tokenizer()
    cache = RadixCache(BlockPool(runner.num_blocks, args.block_size, copy_hook=runner.copy_block))
    prompts: dict[str, tuple[list[int], torch.Tensor]] = {}
    reused = 0
    print(f"\n{'request':<16}{'tokens':>8}{'reused':>8}{'computed':>10}  reply")

    def ask(name: str, tokens: list[int]) -> str:
        nonlocal reused
        hit, generated, first_logits = run_request(cache, runner, tokens, args.new_tokens)
        prompts[name] = (tokens, first_logits)
        reused += hit
        reply = tokenizer.decode(generated, skip_special_tokens=True)
        print(f"{name:<16}{len(tokens):>8}{hit:>8}{len(tokens) - hit:>10}  {reply!r}")
        cache.check_integrity({})
        return reply

    start = time.perf_counter()
    run_program(tokenizer, ask)
    seconds = time.perf_counter() - start
    requests = [tokens for tokens, _ in prompts.values()]
    total = sum(map(len, requests))

    unshared_blocks = sum(cache.pool.blocks_for_tokens(len(t)) for t in requests)
    print(
        f"\n{len(requests)} requests, {total} prompt tokens: {reused} reused from the cache "
        f"({reused / total:.1%}), {total - reused} computed, in {seconds:.1f} s"
    )
    print(f"blocks held by the cache: {cache.pool.num_used} (without sharing: {unshared_blocks})")
    print()
    print(cache.render(decode=tokenizer.decode, max_chars=40))

    # Reuse is exact: the last branch's first reply logits, computed over its reused prefix,
    # against the same prompt computed from scratch in fresh blocks.
    name, (tokens, reused_logits) = list(prompts.items())[-1]
    cache.flush()
    scratch = cache.pool.alloc(cache.pool.blocks_for_tokens(len(tokens)))
    fresh = runner.forward([SequenceInput(tokens, 0, scratch)]).logits[0]
    cache.pool.decref(scratch)
    diff = float((fresh - reused_logits).abs().max())
    print(f"\n{name}: max |logit difference| reused prefix vs from scratch = {diff:.2e}")
    cache.check_integrity({})
    assert cache.pool.num_free == cache.pool.num_blocks
    print("flushed: every block is free again")


if __name__ == "__main__":
    main()
