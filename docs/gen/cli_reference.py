"""Writes reference/cli.md (a virtual page of the site, never a file in docs/) from the
``radixlang`` command's own argparse parser, so the page says what ``--help`` says: one section
per subcommand with its usage, description, examples and a table per group of options.

Run by mkdocs-gen-files at build time (mkdocs.yml); ``python docs/gen/cli_reference.py`` prints
the page instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's code, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_text import cell, code, table, text, write_page  # noqa: E402

from radixlang.cli import build_parser  # noqa: E402

PAGE = "reference/cli.md"
USAGE_WIDTH = 100
# A setting's flag has no argparse default (an absent flag leaves the config file's value); its
# help ends with the setting's default instead.
_DEFAULT_IN_HELP = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name, in the order ``--help`` lists them."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as ``radixlang --help`` lists it."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: choice.help or "" for choice in action._choices_actions}


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=10_000)
    invocation = formatter._format_action_invocation(action)
    help_text = formatter._expand_help(action) if action.help else ""
    default = ""
    m = _DEFAULT_IN_HELP.search(help_text)
    if m:
        default, help_text = m.group(1), help_text[: m.start()]
    elif action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
        default = repr(action.default) if isinstance(action.default, str) else str(action.default)
    # A literal as code; prose ("the model's context") as text.
    shown = cell(default) if " " in default and not default.startswith("'") else code(default)
    return [code(invocation), shown, cell(help_text)]


def _group_table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    return table(["Option", "Default", "Description"], [_option_row(parser, a) for a in actions])


def _examples(epilog: str | None) -> list[str]:
    if not epilog:
        return []
    lines = epilog.splitlines()
    if lines and lines[0].strip() == "examples:":
        lines = lines[1:]
    commands = [line.strip() for line in lines if line.strip()]
    return ["Examples:", "", "```bash", *commands, "```", ""]


def _section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"## `radixlang {name}` {{ #{name} }}", "", f"*{cell(summary)}*", ""]
    out += ["```text", _usage(parser), "```", ""]
    if parser.description:
        out += [text(parser.description), ""]
    out += _examples(parser.epilog)
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        actions = [a for a in actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "options"
        if len(actions) > 8:  # the engine's and server's settings: folded, one click away
            out += [f'??? note "{cell(title)}: {len(actions)} flags"', ""]
            out += ["    " + row for row in _group_table(parser, actions)]
        else:
            out += [f"**{cell(title[:1].upper() + title[1:])}**", ""]
            out += _group_table(parser, actions)
        out.append("")
    return out


def render() -> str:
    parser = build_parser()
    commands, helps = subcommands(parser), summaries(parser)
    out = [
        "# Command line reference",
        "",
        "<!-- Generated from radixlang.cli.build_parser() by docs/gen/cli_reference.py. -->",
        "",
        text(parser.description or ""),
        "",
        "```text",
        _usage(parser),
        "```",
        "",
        "| Command | What it does |",
        "| --- | --- |",
    ]
    out += [f"| [`{name}`](#{name}) | {cell(helps.get(name, ''))} |" for name in commands]
    out += [
        "",
        "Settings flags (engine and server) override the config file, which overrides the "
        "defaults: see [Configuration](configuration.md).",
        "",
    ]
    for name, sub in commands.items():
        out += _section(name, helps.get(name, ""), sub)
    return "\n".join(out).rstrip() + "\n"


write_page(PAGE, render, as_script=__name__ == "__main__")
