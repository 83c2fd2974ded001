"""The OpenAI API tests again (the real ``openai`` client: streams, stops, logprobs, ``n``,
seeds, beam search, errors) on a server whose engine overlaps its steps
(``runtime/overlap.py``): what clients see is the same."""

from __future__ import annotations

import pytest
from test_openai_api import *  # noqa: F403


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    # Deterministic, as in conftest.py: the tests compare outputs across batches and the cache.
    eng = Engine(str(chat_model_dir), kv_memory="64MiB", overlap=True, deterministic=True)
    assert eng.overlap
    yield eng
    assert eng.stats()["overlapped_steps"] > 0  # the tests did run overlapped steps
    eng.shutdown(free_cache=True)  # raises if any block is still held
