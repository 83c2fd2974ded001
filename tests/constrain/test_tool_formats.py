"""Tool-call formats read off chat templates (one per family's style, and one no named format
describes), their grammars sampled by a tiny random model, and their text read back: every
call parses and validates, and the raw output is exactly what the template renders for the
calls read from it."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import pytest
from tool_templates import TEMPLATES, JinjaChat, call_message

from radixlang.config import TOOL_CALL_FORMATS
from radixlang.constrain.tool_calls import call_grammar, parse_output, tools_prompt
from radixlang.constrain.tool_formats import (
    DEFAULT_FORMAT,
    HERMES,
    LLAMA3_JSON,
    NAMED_FORMATS,
    ToolFormat,
    ToolFormatError,
    derive_format,
    format_for,
    from_jinja_render,
    marker_tokens,
    named_format,
)
from radixlang.server.tools import CallStream

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
        "required": ["zone"]}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SPECS = [{"type": "function", "function": {"name": n, "description": f"{n}.", "parameters": s}}
         for n, s in SCHEMAS.items()]  # fmt: skip


def _format(kind: str):
    return derive_format(from_jinja_render(JinjaChat(TEMPLATES[kind])))


# ---- reading formats off templates --------------------------------------------------------


@pytest.mark.parametrize(
    "kind, head, tail, text_before, parallel, trigger",
    [
        ("radixlang", '<tool_call>[{"name": "', "}]</tool_call>", "\n", True, "<tool_call>"),
        ("hermes", '<tool_call>\n{"name": "', "}\n</tool_call>", "\n", True, "<tool_call>"),
        ("llama3-json", '{"name": "', "}", None, False, '{"name": "'),
        ("mistral", '[TOOL_CALLS] [{"name": "', '"}]', None, True, "[TOOL_CALLS]"),
        ("function-tag", "<function=", "</function>", "\n\n", True, "<function="),
    ],
)
def test_each_template_is_read_as_its_format(kind, head, tail, text_before, parallel, trigger):
    fmt = _format(kind)
    assert (fmt.head, fmt.tail, fmt.text_before) == (head, tail, text_before)
    assert (fmt.parallel, fmt.trigger) == (parallel, trigger)
    assert (fmt.id_length is not None) == (kind == "mistral")  # only Mistral writes ids


def test_named_formats_are_the_families_templates():
    assert _format("hermes") == HERMES.__class__(**{**HERMES.__dict__, "name": "template"})
    assert _format("llama3-json") == LLAMA3_JSON.__class__(
        **{**LLAMA3_JSON.__dict__, "name": "template"}
    )
    assert set(TOOL_CALL_FORMATS) == {"auto", "template", *NAMED_FORMATS}
    assert named_format("hermes") is HERMES
    with pytest.raises(ValueError, match=r"unknown tool-call format 'qwen'.*hermes"):
        named_format("qwen")


def _random_arguments(rng: random.Random, name: str) -> dict:
    if name == "get_time":
        return {"zone": rng.choice(["utc", "cet", "pst"])}
    city = "".join(rng.choice('ab "\\é\n{}') for _ in range(rng.randrange(9)))
    return {"city": city, "unit": rng.choice("cf"), "days": rng.randrange(1, 10)}


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_calls_render_as_the_template_writes_them_and_read_back(kind):
    chat = JinjaChat(TEMPLATES[kind])
    fmt = _format(kind)
    rng = random.Random(kind)
    prompt = chat.apply_chat_template(MESSAGES, add_generation_prompt=True)
    end = _turn_end(chat)
    for _ in range(40):
        count = rng.randrange(1, 4) if fmt.parallel else 1
        calls = []
        for k in range(count):
            name = rng.choice(sorted(SCHEMAS))
            calls.append((name, _random_arguments(rng, name), f"{k}bcdefgh{k}"))
        content = rng.choice(["", "Let me look."]) if fmt.text_before is not None else ""
        rendered = chat.apply_chat_template([*MESSAGES, call_message(calls, content)])
        output = (content + fmt.text_before if content else "") + fmt.render(calls)
        assert rendered == prompt + output + end
        before, read = parse_output(output, fmt)
        assert before == content
        assert [(c.name, json.loads(c.arguments), c.id or calls[k][2])
                for k, c in enumerate(read)] == calls  # fmt: skip
        # Every prefix of the text scans as the calls so far (a stream's view).
        at = fmt.locate(output)[1]
        for cut in range(at, len(output)):
            partial, closed = fmt.scan(output[at:cut])
            # (closed early only where the next call's text starts as the tail: "</function>")
            assert not closed or fmt.between.startswith(fmt.tail)
            assert len(partial) <= len(calls)
            for got, (name, _, _) in zip(partial, calls, strict=False):
                assert got.name == name


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_a_format_goes_through_json_unchanged(kind):
    fmt = dataclasses.replace(_format(kind), special=(("<tool_call>", 49152),))
    assert ToolFormat.from_json(json.loads(json.dumps(fmt.as_json()))) == fmt
    with pytest.raises(ValueError, match="not a tool-call format"):
        ToolFormat.from_json({"head": "x"})


def test_templates_whose_calls_cannot_be_read_are_named_in_the_error(caplog):
    ignores = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ToolFormatError, match="does not write an assistant message's tool_calls"):
        derive_format(from_jinja_render(JinjaChat(ignores)))
    as_string = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}({{ c.function.arguments | tojson | tojson }}){% endfor %}"
        "{{ m.content }};{% endfor %}"
    )
    with pytest.raises(ToolFormatError, match="arguments as a string"):
        derive_format(from_jinja_render(JinjaChat(as_string)))
    # An engine falls back to the default format for a template that writes no calls, and
    # for one whose calls cannot be read, with a warning naming why; "template" refuses.
    assert format_for(JinjaChat(ignores)) is DEFAULT_FORMAT
    with caplog.at_level("WARNING"):
        assert format_for(JinjaChat(as_string)) is DEFAULT_FORMAT
    assert "arguments as a string" in caplog.text
    with pytest.raises(ToolFormatError, match="arguments as a string"):
        format_for(JinjaChat(as_string), "template")
    with pytest.raises(ToolFormatError, match="does not write"):
        format_for(JinjaChat(ignores), "template")
    assert format_for(JinjaChat(TEMPLATES["hermes"])).head == HERMES.head
    assert format_for(JinjaChat(TEMPLATES["hermes"]), "mistral") is NAMED_FORMATS["mistral"]


def test_a_marker_written_as_text_in_a_reply_is_not_taken_for_the_calls():
    """Where the marker is a token, a free reply may hold its text; the calls are those after
    the marker that reads as calls."""
    fmt = _format("hermes")
    calls = fmt.render([("get_time", {"zone": "utc"})])
    before, read = parse_output("Use\n<tool_call> tags.\n" + calls, fmt)
    assert before == "Use\n<tool_call> tags." and [c.name for c in read] == ["get_time"]
    assert parse_output("Use\n<tool_call> tags.", fmt) == ("Use\n<tool_call> tags.", [])


def test_a_stream_holds_back_what_may_start_the_calls_then_sends_calls():
    fmt = _format("hermes")
    output = "Let me check <b>.\n" + fmt.render([("get_time", {"zone": "utc"})])
    for step in (1, 3, 7):
        stream = CallStream(True, False, fmt)
        deltas = []
        for i in range(0, len(output), step):
            deltas += stream.feed(output[i : i + step])
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        assert content == "Let me check <b>."  # the newline before the marker is the format's
        items = [i for d in deltas for i in d.get("tool_calls", [])]
        assert items[0]["function"]["name"] == "get_time"
        assert "".join(i["function"]["arguments"] for i in items) == '{"zone": "utc"}'
        assert stream.called and stream.closed
    # Text that only looked like the start of a marker is sent when it ends.
    stream = CallStream(True, False, fmt)
    assert stream.feed("Answer:\n<tool") == [{"content": "Answer:"}]
    assert stream.finish() == [{"content": "\n<tool"}]


# ---- sampled: a tiny random model writing each format -------------------------------------

MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
RUNS = 50


def _turn_end(chat: JinjaChat) -> str:
    text = chat.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "X"}])
    return text[text.rindex("X") + 1 :]


@pytest.fixture(scope="module")
def marker_engine(tmp_path_factory):
    """A tiny random model whose tokenizer has the formats' markers as tokens of their own, as
    the families' tokenizers do (Qwen's <tool_call>, Mistral's [TOOL_CALLS])."""
    from transformers import AutoTokenizer

    from radixlang.runtime.engine import Engine
    from radixlang.testing import write_tiny_chat_model

    folder = write_tiny_chat_model(tmp_path_factory.mktemp("marker-model"), extra_tokens=8)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<function="])
    tokenizer.save_pretrained(folder)
    engine = Engine(str(folder), kv_memory="64MiB")
    yield engine
    engine.shutdown(free_cache=True)


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    engine = Engine(str(chat_model_dir), kv_memory="64MiB")
    yield engine
    engine.shutdown(free_cache=True)


def _bias(engine, fmt) -> dict[int, float]:
    """Logit biases that make the random model (whose logits spread over +-15) write the
    calls' marker, and where text may come before calls the newline before it, in about
    three runs of four: both answers, and text before calls, happen in 50 runs."""
    ids = list(engine.tokenizer.encode(fmt.trigger, add_special_tokens=False))
    bias = dict.fromkeys(ids, 15.0)
    if fmt.text_before:
        for token in engine.tokenizer.encode(fmt.text_before, add_special_tokens=False):
            bias[token] = 15.0
    return bias


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
@pytest.mark.parametrize("setting", ["required", "named", "auto"])
def test_sampled_calls_parse_validate_and_render_back_exactly(marker_engine, kind, setting):
    """Markers as tokens of their own (grammars name the tokens)."""
    fmt = _format(kind)
    fmt = dataclasses.replace(fmt, special=marker_tokens(fmt, marker_engine.tokenizer))
    assert fmt.special or kind == "llama3-json"  # (whose calls are bare JSON)
    _sample(marker_engine, kind, setting, fmt)


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_sampled_calls_with_markers_written_as_text(engine, kind):
    """Markers as text (the default tokenizer has none of them as tokens)."""
    fmt = _format(kind)
    assert not marker_tokens(fmt, engine.tokenizer)
    _sample(engine, kind, "required", fmt)


def _sample(engine, kind: str, setting: str, fmt) -> None:
    chat = JinjaChat(TEMPLATES[kind])
    system = {"role": "system", "content": tools_prompt("auto", SPECS, fmt)}
    messages = [system, *MESSAGES]
    prompt = chat.apply_chat_template(messages, add_generation_prompt=True)
    end = _turn_end(chat)
    tools = [("get_time", TIME)] if setting == "named" else list(SCHEMAS.items())
    mode = "auto" if setting == "auto" else "required"
    # (The bias that makes auto call would also make every call ask for another.)
    parallel = setting != "auto"
    # (Parallel calls may run long; a reply in auto needs no more than 200 tokens to show.)
    sampling = {"temperature": 1.0, "max_new_tokens": 200 if setting == "auto" else 600,
                "skip_special_tokens": False,
                "grammar": call_grammar(mode, tools, parallel, None, fmt)}  # fmt: skip
    if setting == "auto":
        sampling["logit_bias"] = _bias(engine, fmt)
    ids = list(engine.tokenizer.encode(prompt, add_special_tokens=False))
    results = engine.generate([ids] * RUNS, [{**sampling, "seed": k} for k in range(RUNS)])
    counts = {"calls": 0, "text first": 0, "text": 0}
    for result in results:
        text = result.text
        before, calls = parse_output(text, fmt)
        if not calls:
            assert setting == "auto" and result.finish_reason.value in ("stop", "length")
            assert fmt.trigger not in text if fmt.text_before else not fmt.locate(text)
            counts["text"] += 1
            continue
        assert result.finish_reason.value == "stop", text  # the grammar ended the turn
        counts["calls"] += 1
        counts["text first"] += bool(before)
        for call in calls:
            assert call.name in dict(tools)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        message = call_message(
            [(c.name, json.loads(c.arguments), c.id or "") for c in calls], before
        )
        assert chat.apply_chat_template([*messages, message]) == prompt + text + end
    if setting != "auto":
        assert counts["calls"] == RUNS
    elif kind != "llama3-json":  # calls happen, after text where the format allows it
        # (Llama 3's marker is four text tokens, which a bias cannot put in order: its auto
        # calls are walked in test_a_started_bare_json_call_is_held_to_a_valid_call.)
        assert counts["calls"] >= 10, counts
        if fmt.text_before is not None:
            assert counts["text first"] >= 10, counts


def test_a_started_bare_json_call_is_held_to_a_valid_call(engine):
    """Llama 3's auto: once the output starts as a call, it is a valid one (random allowed
    tokens after the marker), rendered back exactly; text that only starts like one is text."""
    from radixlang.constrain import compile_grammar

    fmt = _format("llama3-json")
    chat = JinjaChat(TEMPLATES["llama3-json"])
    grammar = compile_grammar("grammar", call_grammar("auto", list(SCHEMAS.items()), True,
                              None, fmt), engine.tokenizer, engine.runner.vocab_size,
                              engine.eos_token_ids)  # fmt: skip
    rng = random.Random(0)
    prompt = chat.apply_chat_template(MESSAGES, add_generation_prompt=True)
    for _ in range(10):
        constraint = grammar.new_constraint()
        tokens = list(engine.tokenizer.encode(fmt.trigger, add_special_tokens=False))
        for token in tokens:
            constraint.advance(token)
        while not constraint.is_finished() and not constraint.may_end() and len(tokens) < 300:
            allowed = constraint.allowed_mask().nonzero().flatten().tolist()
            token = rng.choice([t for t in allowed if t not in engine.eos_token_ids])
            constraint.advance(token)
            tokens.append(token)
        text = engine.tokenizer.decode(tokens)
        _, (call,) = parse_output(text, fmt)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        message = call_message([(call.name, json.loads(call.arguments), "")])
        assert chat.apply_chat_template([*MESSAGES, message]) == prompt + text + _turn_end(chat)
    text_start = grammar.new_constraint()
    for token in engine.tokenizer.encode('{"nam is text', add_special_tokens=False):
        text_start.advance(token)
    assert text_start.may_end()


def test_a_reasoning_template_s_thinking_block_is_not_part_of_the_calls():
    """Qwen3's template opens the last assistant turn with a thinking block: the format is the
    Hermes one after it (the thinking is the reasoning constraint's, before the answer's)."""
    from tool_templates import QWEN3

    chat = JinjaChat(QWEN3)
    fmt = derive_format(from_jinja_render(chat))
    assert (fmt.head, fmt.between, fmt.tail) == (HERMES.head, HERMES.between, HERMES.tail)
    assert fmt.text_before == "\n" and fmt.trigger == "<tool_call>"
    calls = [("get_time", {"zone": "utc"}, "x")]
    rendered = chat.apply_chat_template([*MESSAGES, call_message(calls, "Checking.")])
    assert rendered.endswith("</think>\n\nChecking." + "\n" + fmt.render(calls) + "<|im_end|>\n")


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    """A tiny random reasoning model with Qwen3's template shape: <think>, </think>,
    <tool_call> and </tool_call> as tokens of their own."""
    from tool_templates import QWEN3
    from transformers import AutoTokenizer

    from radixlang.runtime.engine import Engine
    from radixlang.testing import write_tiny_chat_model

    folder = write_tiny_chat_model(tmp_path_factory.mktemp("qwen3-model"), extra_tokens=8)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN3)
    engine = Engine(str(folder), kv_memory="64MiB")
    yield engine
    engine.shutdown(free_cache=True)


def test_calls_after_thinking_follow_the_whitespace_the_template_writes(qwen3_engine):
    """After </think> the model may write what the template writes there ("\\n\\n", not the
    answer's), then the calls: the answer reads back as the template renders it."""
    from tool_templates import QWEN3

    from radixlang.constrain.reasoning import split_reasoning

    engine = qwen3_engine
    markers, fmt = engine.reasoning_markers, engine.tool_format
    gap = engine.tokenizer.encode("\n\n", add_special_tokens=False)
    assert markers is not None and markers.after_close == tuple(gap)
    assert fmt.head == HERMES.head and fmt.special
    chat = JinjaChat(QWEN3)
    prompt = chat.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = list(engine.tokenizer.encode(prompt, add_special_tokens=False))
    grammar = call_grammar("required", list(SCHEMAS.items()), False, None, fmt)
    sampling = {"temperature": 1.0, "max_new_tokens": 200, "skip_special_tokens": False,
                "thinking_budget": 6, "logit_bias": {markers.open_id: 15.0, gap[0]: 15.0},
                "grammar": grammar}  # fmt: skip
    results = engine.generate([ids] * RUNS, [{**sampling, "seed": k} for k in range(RUNS)])
    after_gap = 0
    for result in results:
        assert result.finish_reason.value == "stop", result.text
        reasoning, answer = split_reasoning(result.text)
        (call,) = parse_output(answer, fmt)[1]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert answer == fmt.render([(call.name, json.loads(call.arguments))])
        if reasoning is not None and result.text.endswith("</think>\n\n" + answer):
            after_gap += 1
            message = {**call_message([(call.name, json.loads(call.arguments), "")]),
                       "reasoning_content": reasoning}  # fmt: skip
            rendered = chat.apply_chat_template([*MESSAGES, message])
            assert rendered.endswith("</think>\n\n" + answer + _turn_end(chat))
    assert after_gap >= 10
