"""The README's program example runs as written, on the default model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_program_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## A program") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)[1]
    namespace: dict = {}
    try:
        exec(compile(code, str(README), "exec"), namespace)
        state = namespace["state"]
        assert len(state["draft"]) == 3 and state["best"] in ("1", "2", "3")
        roles = [m["role"] for m in state.messages()]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert len(namespace["states"]) == 2
        assert capsys.readouterr().out.splitlines()[-1] == "True"  # prefixes were reused
    finally:
        import radixlang as sgl

        backend = sgl.get_default_backend()
        if backend is not None:
            backend.shutdown()
        sgl.set_default_backend(None)
