"""An in-process engine on the tiny chat model, shared by the REPL's backend and program tests.
Deterministic: a seeded reply asked for again (alone, or beside its forks, its prompt cached)
must be the same text in either dtype "auto" picks."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    eng = Engine(str(chat_model_dir), kv_memory="64MiB", deterministic=True)
    yield eng
    eng.shutdown(free_cache=True)  # raises if any block is still held


@pytest.fixture()
def local_chat(engine):
    from radixlang.repl.local import LocalChat

    engine.flush_cache()
    return LocalChat(engine)
