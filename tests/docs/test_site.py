"""The documentation site builds with ``mkdocs build --strict`` (a warning fails it: a broken
link or anchor, a page missing from the nav, an API name that does not resolve), and its
generated pages hold what the code holds: every subcommand of the parser, every setting and
sampling field, the engine's docstring.

mkdocs comes with the ``docs`` extra (scripts/setup.sh installs it); where it is missing the
test fails, it never skips.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixlang.cli import build_parser
from radixlang.config import SETTINGS
from radixlang.sampling_fields import SAMPLING_FIELDS

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    assert MKDOCS.exists(), (
        f"{MKDOCS} is missing: the docs extra is not installed (pip install -e '.[docs]', "
        "which scripts/setup.sh does)"
    )
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_MKDOCS_2_WARNING="1")
    env["DISABLE_MKDOCS_2_WARNING"] = "true"
    # This checkout's code, whatever the venv has installed (docs/gen/ and mkdocstrings read it).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr}\n{proc.stdout}"
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text: tags dropped, entities decoded, whitespace collapsed."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", raw)).split())


def subcommands() -> list[str]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_every_nav_page_is_built(site):
    for page in ("index.html", "getting-started/index.html", "scale-out/index.html"):
        assert (site / page).is_file(), page
    for page in ("cli", "configuration", "api/runtime", "api/language", "api/server"):
        assert (site / "reference" / page / "index.html").is_file(), page


def test_the_cli_reference_has_every_subcommand_and_its_options(site):
    text = page_text(site, "reference/cli")
    commands = subcommands()
    assert {"run", "generate", "serve", "config"} <= set(commands)
    for name in commands:
        assert f"radixlang {name}" in text, name
        assert f"usage: radixlang {name}" in text, name
    # Options from the parser itself: a subcommand's own flag and the settings' flags.
    for flag in ("--max-new-tokens", "--show-tree", "--kv-memory", "--api-keys-file"):
        assert flag in text, flag


def test_the_configuration_reference_has_every_setting_and_sampling_field(site):
    text = page_text(site, "reference/configuration")
    for setting in SETTINGS.values():
        assert setting.key in text and setting.flag in text, setting.name
    for field in SAMPLING_FIELDS:
        assert field.name in text, field.name


def test_the_api_reference_renders_the_docstrings(site):
    from radixlang.runtime import Engine, RadixCache

    for cls, page in ((Engine, "reference/api/runtime"), (RadixCache, "reference/api/runtime")):
        # The sentence as rendered: reST roles as code (docs/gen/rst_roles.py), `` as `.
        first = re.sub(r":[a-z]+:`~?([\w.]+\.)?(\w+)`", r"\2", re.split(r"\.\s", cls.__doc__)[0])
        first_sentence = "".join(first.replace("``", "").split())  # tags left spaces around code
        assert first_sentence in "".join(page_text(site, page).split()), (cls.__name__, first)
    language = page_text(site, "reference/api/language")
    for name in ("function", "gen", "select", "set_default_backend"):
        assert re.search(rf"\b{name}\b", language), name
    assert "serve_in_thread" in page_text(site, "reference/api/server")
    assert "ReplicaSet" in page_text(site, "reference/api/cluster")
