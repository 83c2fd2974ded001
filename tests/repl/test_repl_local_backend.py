"""The REPL's local backend on a real engine: streamed turns, forks over one cached prompt,
Ctrl-C (cancel) that leaves no block held, the cache's tree and figures."""

from __future__ import annotations

import time

import pytest

from radixlang.repl.backends import BackendError, Generation, Piece


def collect(generation: Generation, timeout: float = 60.0) -> dict[int, list[Piece]]:
    pieces: dict[int, list[Piece]] = {i: [] for i in range(generation.n)}
    deadline = time.monotonic() + timeout
    while not all(p and p[-1].done for p in pieces.values()):
        assert time.monotonic() < deadline, "the generation did not finish"
        piece = generation.next_piece(0.1)
        if piece is not None:
            pieces[piece.branch].append(piece)
    return pieces


SAMPLING = {"temperature": 0.8, "max_new_tokens": 16, "top_p": 1.0, "top_k": -1, "seed": 3}


def test_a_turn_streams_in_pieces_and_the_next_turn_reuses_it(local_chat):
    messages = [{"role": "user", "content": "Name a colour."}]
    (pieces,) = collect(local_chat.chat(messages, SAMPLING, 1)).values()
    *texts, last = pieces
    assert len(texts) > 1 and all(p.text and not p.done for p in texts)  # token by token
    usage = last.usage
    assert last.done and last.error is None and usage.completion_tokens == 16
    prompt = local_chat.prompt_ids(messages)
    assert usage.prompt_tokens == len(prompt) and usage.cached_tokens == 0
    reply = "".join(p.text for p in texts)
    # The template's own rendering of the conversation, as the server's chat route makes it.
    template = local_chat.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)  # fmt: skip
    assert local_chat.tokenizer.decode(prompt) == template
    follow = [*messages, {"role": "assistant", "content": reply},
              {"role": "user", "content": "Another?"}]  # fmt: skip
    (pieces,) = collect(local_chat.chat(follow, SAMPLING, 1)).values()
    second = pieces[-1].usage
    # The first turn's prompt and reply were cached, and the prompt repeats the reply's own
    # tokens (all but the last sampled one have KV), so only the new message is computed.
    assert second.cached_tokens >= len(prompt) + usage.completion_tokens - 1
    tail = "<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n<|im_start|>assistant\n"
    new_message = local_chat.tokenizer.encode(tail, add_special_tokens=False)
    assert second.computed_tokens <= len(new_message) + 1


def test_fork_branches_share_one_computed_prompt(local_chat):
    messages = [{"role": "user", "content": "Write one word about the sea, please."}]
    prompt = len(local_chat.prompt_ids(messages))
    result = collect(local_chat.chat(messages, SAMPLING, 3))
    usages = [pieces[-1].usage for pieces in result.values()]
    assert all(u.prompt_tokens == prompt and u.completion_tokens == 16 for u in usages)
    # One branch computes the prompt; the others take it from the cache (their last token is
    # always computed: its logits pick the first reply token).
    assert sum(u.computed_tokens for u in usages) <= prompt + 2
    assert sorted(u.cached_tokens for u in usages)[1:] == [prompt - 1, prompt - 1]
    texts = ["".join(p.text for p in pieces) for pieces in result.values()]
    assert len(set(texts)) == 3  # a set seed becomes seed + branch: the branches differ
    stats = local_chat.stats()
    assert stats["blocks_held_by_requests"] == 0 and stats["integrity"] == "ok"


def test_cancel_aborts_and_frees_every_block(local_chat):
    messages = [{"role": "user", "content": "Tell a long story."}]
    sampling = {**SAMPLING, "max_new_tokens": 900, "temperature": 0.0}
    generation = local_chat.chat(messages, sampling, 2)
    first = generation.next_piece(30)
    assert first is not None and not first.done
    generation.cancel()
    result = collect(generation)
    assert generation.join(10)
    for pieces in result.values():
        usage = pieces[-1].usage
        assert usage.finish_reason == "abort" and usage.completion_tokens < 900
    stats = local_chat.stats()
    assert stats["running_requests"] == 0 and stats["waiting_requests"] == 0
    assert stats["blocks_held_by_requests"] == 0 and stats["integrity"] == "ok"


def test_the_tree_shows_the_prompt_and_flush_empties_it(local_chat):
    messages = [{"role": "user", "content": "zebra crossing"}]
    collect(local_chat.chat(messages, SAMPLING, 2))
    tree, decode = local_chat.cache_tree()
    (top,) = tree["children"]  # the shared prompt is one node
    assert "zebra crossing" in decode(top["token_ids"])
    assert len(top["children"]) == 2 or len(top["children"][0]["children"]) == 2
    local_chat.flush()
    assert local_chat.cache_tree()[0]["children"] == []
    assert local_chat.stats()["blocks_used"] == 0


def test_a_prompt_past_the_context_window_is_a_clear_error(local_chat):
    messages = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(BackendError, match="context window"):
        local_chat.chat(messages, SAMPLING, 1)


@pytest.mark.compares_outputs
def test_a_set_seed_numbers_replies_so_forks_add_new_ones(local_chat):
    messages = [{"role": "user", "content": "Pick a number."}]

    def replies(n: int, first: int) -> list[str]:
        result = collect(local_chat.chat(messages, SAMPLING, n, first))
        return ["".join(p.text for p in pieces) for pieces in result.values()]

    (original,) = replies(1, 0)
    forks = replies(2, 1)  # replies 2 and 3 of the message
    assert len({original, *forks}) == 3
    assert replies(1, 0) == [original] and replies(1, 2) == forks[1:]  # each repeats
