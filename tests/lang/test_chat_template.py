"""Role boundaries read off jinja chat templates of several shapes."""

from __future__ import annotations

import jinja2

from radixlang.lang.chat_template import PLAIN, from_jinja, from_tokenizer


class JinjaTokenizer:
    """Just enough of a tokenizer to render a chat template."""

    def __init__(self, template: str | None, bos: str = "") -> None:
        self.chat_template = template
        self.bos = bos

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        def raise_exception(msg):
            raise ValueError(msg)

        env = jinja2.Environment()
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos
        )


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
NO_SYSTEM = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)


def test_llama3_style_template_puts_bos_only_at_the_start():
    t = from_tokenizer(JinjaTokenizer(LLAMA3, bos="<|begin_of_text|>"))
    assert t.prefix["user"] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert t.first_prefix["user"].startswith("<|begin_of_text|>")
    assert t.first_prefix["system"].startswith("<|begin_of_text|>")
    assert t.suffix["assistant"] == "<|eot_id|>"
    assert t.stop_str == ("<|eot_id|>",)
    assert t.default_system_prompt is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tok = JinjaTokenizer(LLAMA3, bos="<|begin_of_text|>")
    assert t.render(msgs, add_generation_prompt=True) == tok.apply_chat_template(
        msgs, add_generation_prompt=True
    )


def test_a_template_that_rejects_system_keeps_its_turns():
    tok = JinjaTokenizer(NO_SYSTEM, bos="<s>")
    t = from_tokenizer(tok)
    assert t.prefix["user"] == "[INST] " and t.suffix["user"] == " [/INST]"
    assert t.first_prefix["user"] == "<s>[INST] "
    assert t.suffix["assistant"] == "</s>" and t.stop_str == ("</s>",)
    msgs = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
            {"role": "user", "content": "V"}]  # fmt: skip
    assert t.render(msgs) == tok.apply_chat_template(msgs)
    # A system message becomes a paragraph after BOS, before the first turn.
    assert t.render([{"role": "system", "content": "S"}, msgs[0]]) == "<s>S\n\n[INST] U [/INST]"


def test_unreadable_template_is_plain():
    assert from_tokenizer(JinjaTokenizer("{{ raise_exception('never') }}")) is PLAIN


def test_no_template_is_plain():
    assert from_tokenizer(JinjaTokenizer(None)) is PLAIN
    assert PLAIN.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "User: hi\nAssistant:"
    )


def test_from_jinja_reads_the_default_models_template_as_its_tokenizer_does(chat_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    from_text = from_jinja(tok.chat_template, "tiny", tok.bos_token, tok.eos_token)
    assert from_text == from_tokenizer(tok, "tiny")
    assert from_text.default_system_prompt.startswith("You are a helpful AI assistant")


def test_from_jinja_matches_from_tokenizer_on_templates_of_other_shapes():
    for template, bos in ((LLAMA3, "<|begin_of_text|>"), (NO_SYSTEM, "<s>")):
        expected = from_tokenizer(JinjaTokenizer(template, bos), "m")
        assert from_jinja(template, "m", bos_token=bos) == expected
        assert expected != PLAIN
    # Without a BOS the template renders none, as a tokenizer without one does.
    assert from_jinja(LLAMA3, "m") == from_tokenizer(JinjaTokenizer(LLAMA3, ""), "m")
