"""The frontend's runtime fixture: a local runtime on the tiny chat model (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_runtime(chat_model_dir):
    import radixlang as sgl

    # float32: select's scores are compared with float32 transformers ("auto" may be bf16).
    # Deterministic: programs' outputs are compared with the engine's for the same prompt run
    # again (its prefix cached then), which must not change a token even in float32.
    rt = sgl.Runtime(
        model_path=str(chat_model_dir), kv_memory="64MiB", dtype="float32", deterministic=True
    )
    yield rt
    rt.shutdown()
