"""The append-only check of chat templates: the shipped tiny chat model's (ChatML, as SmolLM2's)
extends its earlier renderings; a Qwen3-style template that drops old thinking, and one that
rewrites the system message as the conversation grows, are reported with where they differ;
the server shows it in /get_server_info and warns at start."""

from __future__ import annotations

import copy
import logging

import pytest

from radixlang.server.template_check import check_template

# Qwen3's rule, in short: an earlier assistant turn is rendered without its <think> block.
DROPS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The system message counts the turns so far: every rendering differs from the last early on.
COUNTS_TURNS = (
    "<|im_start|>system\nTurn {{ messages | length }}.<|im_end|>\n"
    "{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_the_tiny_chat_models_template_is_append_only(tokenizer):
    check = check_template(tokenizer)
    assert check.append_only is True and check.detail == ""


def test_a_template_that_drops_old_thinking_is_reported(tokenizer):
    check = check_template(with_template(tokenizer, DROPS_THINKING))
    assert check.append_only is False
    assert "thinking" in check.detail and "<think>" in check.detail


def test_a_template_that_rewrites_the_system_message_is_reported(tokenizer):
    check = check_template(with_template(tokenizer, COUNTS_TURNS))
    assert check.append_only is False and "character 24 of" in check.detail


def test_no_template_is_no_answer(tokenizer):
    assert check_template(None).append_only is None
    assert check_template(with_template(tokenizer, "")).append_only is None


def test_the_server_reports_it_and_warns_at_start(client, engine, caplog):
    info = client.get("/get_server_info").json()
    assert info["chat_template"] == {"append_only": True, "detail": ""}
    from radixlang.server.app import create_app

    bad = copy.copy(engine)
    bad.tokenizer = with_template(engine.tokenizer, DROPS_THINKING)
    with caplog.at_level(logging.WARNING, logger="radixlang.server.app"):
        create_app(bad, dashboard=False)  # built, never served: nothing starts
    assert any("not append-only" in r.message for r in caplog.records)
