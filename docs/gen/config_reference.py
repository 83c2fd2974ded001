"""Writes reference/configuration.md (a virtual page of the site) from the tables the code itself
reads: the settings of radixlang/config.py (``[engine]`` and ``[server]`` of a config file,
their flags and ``Engine``'s keyword arguments) and the sampling fields of
radixlang/sampling_fields.py (``sampling_params``, ``gen()``'s keywords, OpenAI body fields).

Run by mkdocs-gen-files at build time (mkdocs.yml); ``python docs/gen/config_reference.py``
prints the page instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's code, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_text import cell, code, table, text, write_page  # noqa: E402

from radixlang.config import CLUSTER_KEYS, CONFIG_ENV, SECTIONS, SETTINGS, Setting  # noqa: E402
from radixlang.sampling_fields import KINDS, SAMPLING_FIELDS, SamplingField  # noqa: E402

PAGE = "reference/configuration.md"


def _toml(value: Any) -> str:
    """A default as a config file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _setting_row(s: Setting) -> list[str]:
    flags = ", ".join(code(f) for f in (s.flag, *s.aliases))
    kind = s.kind.description
    default = code(_toml(s.default)) if s.default is not None else "unset"
    return [code(s.key), flags, cell(kind), default, cell(s.help)]


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _field_row(f: SamplingField) -> list[str]:
    bounded = f.rule is not None or f.minimum is not None or f.maximum is not None
    openai = code(f.openai) + (" (OpenAI's own)" if f.openai_official else "") if f.openai else ""
    return [
        code(f.name),
        code(_type_name(KINDS[f.kind])),
        code(repr(f.default)),
        cell(f.describe()) if bounded else "",
        code(f.gen or ""),
        openai,
        cell(f.help),
    ]


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from radixlang/config.py and radixlang/sampling_fields.py by "
        "docs/gen/config_reference.py. -->",
        "",
        text(
            "The commands that make an engine (`generate`, `serve`, `run`, `repl`, `memory`) read "
            "one configuration: a TOML file with `[engine]` and `[server]` tables (`--config "
            f"FILE`, or `${CONFIG_ENV}`), under the flags given; `radixlang config --print` "
            "prints the effective one. A value's flag wins over the file's, the file's over the "
            "default. The `[engine]` keys are also `Engine(...)`'s and `Runtime(...)`'s keyword "
            "arguments."
        ),
        "",
        "```toml",
        "[engine]",
        'dtype = "bfloat16"',
        'kv_memory = "2GiB"',
        "",
        "[server]",
        "port = 8000",
        "```",
        "",
    ]
    header = ["Key", "Flag", "Value", "Default", "Description"]
    for section in SECTIONS:
        settings = [s for s in SETTINGS.values() if s.section == section]
        out += [f"## `[{section}]` {{ #{section} }}", ""]
        if section == "server":
            keys = ", ".join(f"`{k}`" for k in CLUSTER_KEYS)
            out += [text(f"{keys} shape the replica set of `serve --replicas N`."), ""]
        out += [*table(header, [_setting_row(s) for s in settings]), ""]
    out += [
        "## Sampling parameters { #sampling }",
        "",
        text(
            "One table (`radixlang/sampling_fields.py`) gives every layer its sampling "
            "vocabulary: the engine's `sampling_params` (SGLang's names, `/generate`), `gen()` "
            "and `run()` keywords (where named), and the fields of OpenAI-style request bodies."
        ),
        "",
    ]
    header = ["Field", "Type", "Default", "Allowed", "gen() keyword", "OpenAI field", "Meaning"]
    out += table(header, [_field_row(f) for f in SAMPLING_FIELDS])
    return "\n".join(out).rstrip() + "\n"


write_page(PAGE, render, as_script=__name__ == "__main__")
