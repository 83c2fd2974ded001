"""The REPL on an in-process engine: chat turns as engine requests, the cache read directly.

Prompts are the tokenizer's ``apply_chat_template`` of the active messages, as token ids (no
second BOS). Every turn's prompt text extends an earlier prompt and its reply, which the engine
left in its radix cache; that part of the prompt is sent as the very token ids the engine
cached (the reply as it was sampled, not re-tokenized, which may split its text differently),
and only the rest is tokenized. So a turn computes only its new message, and a fork's branches
share one prompt, computed once. The cache's tree and the blocks held outside it are read on
the engine thread (``Engine._call``), between steps.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from radixlang.lang.backends.local import LocalBackend
from radixlang.lang.chat_template import from_tokenizer
from radixlang.repl.backends import (
    BackendError,
    ChatBackend,
    Generation,
    Piece,
    branch_sampling,
)
from radixlang.repl.session import Usage
from radixlang.runtime.block_pool import IntegrityError
from radixlang.runtime.engine import Engine, RequestError
from radixlang.runtime.handle import RequestHandle
from radixlang.runtime.request import FinishReason

MAX_KNOWN_SEQUENCES = 256


class LocalChat(ChatBackend):
    def __init__(self, engine: Engine) -> None:
        if engine.tokenizer is None:
            raise BackendError(f"model {engine.files.name} has no tokenizer: a chat needs one")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = engine.files.name
        self.where = "local"
        # The end-of-turn text is a stop string too: some models end a turn with a token
        # that is not their EOS.
        self.stop = list(from_tokenizer(self.tokenizer, self.name).stop_str)
        self._program_backend: LocalBackend | None = None
        # Text -> the token ids the engine cached for it: recent prompts and prompt + reply.
        self._known: OrderedDict[str, list[int]] = OrderedDict()
        self._known_lock = threading.Lock()

    @classmethod
    def start(cls, **engine_kwargs: Any) -> LocalChat:
        return cls(Engine(**engine_kwargs))

    # ---- chat ------------------------------------------------------------------------------
    def prompt_text(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return from_tokenizer(self.tokenizer, self.name).render(messages, True)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's token ids: those of the longest known sequence its text starts with,
        then the rest tokenized."""
        text = self.prompt_text(messages)
        with self._known_lock:
            known = max((k for k in self._known if text.startswith(k)), key=len, default="")
            ids = list(self._known[known]) if known else []
        return ids + list(self.tokenizer.encode(text[len(known) :], add_special_tokens=False))

    def _remember(self, ids: list[int]) -> None:
        # A reply may hold bytes that are not whole characters ("\ufffd" in its text): a prompt
        # that repeats that text is sent with the reply's own tokens, the bytes the model wrote.
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        with self._known_lock:
            self._known[text] = ids
            self._known.move_to_end(text)
            while len(self._known) > MAX_KNOWN_SEQUENCES:
                self._known.popitem(last=False)

    def chat(
        self, messages: list[dict[str, str]], sampling: dict[str, Any], n: int, first: int = 0
    ) -> Generation:
        ids = self.prompt_ids(messages)
        handles: list[RequestHandle] = []
        try:
            for i in range(n):  # submitted together: the engine computes their prompt once
                params = {**branch_sampling(sampling, first + i), "stop": self.stop}
                handles.append(self.engine.submit(ids, params))
        except RequestError as e:
            for h in handles:
                h.abort()
            raise BackendError(str(e)) from None

        def abort_all() -> None:
            for h in handles:
                h.abort()

        self._remember(ids)
        return Generation(n, _stream_of(handles, self._remember), on_cancel=abort_all)

    # ---- the cache -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = dict(self.engine.stats())

        def outside_tree() -> int:
            tree_blocks = self.engine.cache.describe(max_nodes=0)["tree_blocks"]
            return self.engine.pool.num_used - tree_blocks

        # Blocks in use that the tree does not hold: running requests' own blocks. Zero when
        # idle, or a request leaked them.
        stats["blocks_held_by_requests"] = self.engine._call(outside_tree)
        try:
            self.engine.check_integrity()
            stats["integrity"] = "ok"
        except IntegrityError as e:
            stats["integrity"] = f"FAILED: {e}"
        stats["model"] = self.name
        return stats

    def cache_tree(self, max_nodes: int = 200) -> tuple[dict[str, Any], Callable[[list[int]], str]]:
        tree = self.engine._call(lambda: self.engine.cache.describe(max_nodes=max_nodes))
        return tree, self._decode

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def flush(self) -> None:
        if not self.engine.flush_cache():
            raise BackendError("requests are running: the cache was not flushed")

    # ---- programs and lifetime -------------------------------------------------------------
    def program_backend(self) -> LocalBackend:
        if self._program_backend is None:
            self._program_backend = LocalBackend(self.engine)
        return self._program_backend

    def close(self) -> None:
        self.engine.shutdown()


def _stream_of(
    handles: list[RequestHandle], remember: Callable[[list[int]], None]
) -> Callable[[int, threading.Event], Iterator[Piece]]:
    def stream(branch: int, cancelled: threading.Event) -> Iterator[Piece]:
        handle = handles[branch]
        for event in handle:
            if event.text:
                yield Piece(branch, event.text)
        result = handle.result(raise_on_error=False)
        if result.finish_reason is FinishReason.ERROR:
            yield Piece(branch, done=True, error=result.error or "the engine failed the request")
            return
        remember(result.prompt_ids + result.output_ids)
        usage = Usage(
            result.prompt_tokens,
            result.cached_tokens,
            result.completion_tokens,
            result.finish_reason.value,
        )
        yield Piece(branch, done=True, usage=usage)

    return stream
