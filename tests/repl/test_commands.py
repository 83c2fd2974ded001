"""Parsing /commands and /set values: every mistake is a message that says what is expected."""

from __future__ import annotations

import pytest

from radixlang.repl.commands import (
    COMMANDS,
    CommandError,
    dispatch,
    is_command,
    parse_assignments,
    parse_command,
    parse_count,
)
from radixlang.repl.settings import SettingError, Settings


def test_commands_parse_with_their_arguments():
    fork = parse_command("/fork 3 tell me  a joke")
    assert fork.name == "fork" and fork.args == ["3", "tell", "me", "a", "joke"]
    assert fork.rest == "3 tell me  a joke"
    assert parse_command("/run tips topic='working from home' num_tips=2").args == [
        "tips", "topic=working from home", "num_tips=2"]  # fmt: skip
    assert parse_command("  /QUIT ").name == "exit"
    assert parse_command("/?").name == "help"
    assert is_command("/stats") and not is_command("//etc is a path") and not is_command("hi")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/frok 2", r"unknown command /frok \(did you mean /fork\?\)"),
        ("/zzz", "unknown command /zzz: /help lists them"),
        ("/", "empty command"),
        ("/pick", r"usage: /pick K"),
        ("/pick 1 2", r"usage: /pick K"),
        ("/tree now", r"usage: /tree"),
        ("/load", r"usage: /load FILE.py"),
        ("/run tips topic='open", "No closing quotation"),
    ],
)
def test_bad_command_lines_say_what_is_expected(line, message):
    with pytest.raises(CommandError, match=message):
        parse_command(line)


def test_counts_and_assignments():
    assert parse_count("3", "N", 1, 16) == 3
    with pytest.raises(CommandError, match="N must be a whole number, got 'x'"):
        parse_count("x", "N")
    with pytest.raises(CommandError, match="N must be at least 1 and at most 16, got 17"):
        parse_count("17", "N", 1, 16)
    values = parse_assignments(["n=2", "t=0.5", "flag=True", "xs=[1, 2]", "topic=green tea"])
    assert values == {"n": 2, "t": 0.5, "flag": True, "xs": [1, 2], "topic": "green tea"}
    with pytest.raises(CommandError, match="expected key=value, got 'oops'"):
        parse_assignments(["oops"])


def test_dispatch_runs_the_handler_and_reports_exit():
    seen = []
    handlers = {"stats": lambda c: seen.append(c.name), "exit": lambda c: False}
    assert dispatch("/stats", handlers) is True and seen == ["stats"]
    assert dispatch("/exit", handlers) is False
    with pytest.raises(CommandError, match="/tree is not available here"):
        dispatch("/tree", handlers)


def test_every_command_has_usage_and_summary():
    for spec in COMMANDS:
        assert spec.usage.startswith("/" + spec.name) and spec.summary


def test_settings_check_each_value():
    settings = Settings()
    assert settings.set("temperature", "0") == 0.0
    assert settings.set("max_tokens", "64") == 64
    assert settings.set("top_k", "0") == -1
    assert settings.set("seed", "7") == 7 and settings.set("seed", "none") is None
    assert settings.set("system", "You are terse.") == "You are terse."
    assert settings.sampling() == {"temperature": 0.0, "max_new_tokens": 64, "top_p": 1.0,
                                   "top_k": -1}  # fmt: skip
    assert settings.set("ignore_eos", "on") is True
    assert settings.sampling()["ignore_eos"] is True
    assert settings.set("ignore_eos", "off") is False and "ignore_eos" not in settings.sampling()
    for key, raw, message in [
        ("temperature", "-1", "temperature must be >= 0"),
        ("temperature", "hot", "temperature must be a number, got 'hot'"),
        ("temperature", "nan", "temperature must be finite"),
        ("max_tokens", "0", "max_tokens must be >= 1"),
        ("top_p", "1.5", r"top_p must be in \(0, 1\]"),
        ("top_k", "2.5", "top_k must be an integer"),
        ("seed", "-3", "seed must be >= 0"),
        ("ignore_eos", "maybe", "ignore_eos is on or off, got 'maybe'"),
        ("colour", "red", "unknown setting 'colour': one of temperature, max_tokens"),
    ]:
        with pytest.raises(SettingError, match=message):
            settings.set(key, raw)
