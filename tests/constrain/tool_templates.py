"""Chat templates in the tool-call styles of the model families, for tests: each renders an
assistant turn's ``tool_calls`` the way that family's released template does (markers, keys,
one block per call or a list, ids, what happens to the text before calls)."""

from __future__ import annotations

from typing import Any

from radixlang.lang.chat_template import _JinjaTemplate

# SmolLM2's ChatML turns, calls as radixlang's one JSON array between markers.
RADIXLANG = """\
{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}
{%- if m.content %}{{ m.content }}{% endif %}
{%- if m.tool_calls %}{% if m.content %}{{ '\\n' }}{% endif %}{{ '<tool_call>[' }}
{%- for c in m.tool_calls %}{% if not loop.first %}{{ ', ' }}{% endif %}
{{- '{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}' }}
{%- endfor %}{{ ']</tool_call>' }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

# Qwen2.5 / Qwen3 / Hermes: a <tool_call> block per call, a newline before each.
HERMES = """\
{%- for m in messages %}
{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant' }}
{%- if m.content %}{{ '\\n' + m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}{% set f = c.function %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) }}
{{- '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}
{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

# Llama 3.1: the turn is one bare JSON call with "parameters"; the text of a calling turn is
# dropped; more than one call is refused.
LLAMA3_JSON = """\
{%- for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}
{%- if m.tool_calls %}{% if m.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}{% endif %}
{%- set f = m.tool_calls[0].function %}
{{- '{"name": "' + f.name + '", "parameters": ' + (f.arguments | tojson) + '}' }}
{%- else %}{{ m.content | trim }}{% endif %}{{ '<|eot_id|>' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# Mistral v0.3: [TOOL_CALLS] and a list of calls, each with a 9-character id; no generation
# prompt; the turn ends with EOS.
MISTRAL = """\
{{- bos_token }}{%- for m in messages %}
{%- if m.role == 'user' %}{{ '[INST] ' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}{{ '[TOOL_CALLS] [' }}
{%- for c in m.tool_calls %}{% set out = c.function | tojson %}{{ out[:-1] }}
{%- if c.id is not defined or c.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{{- ', "id": "' + c.id + '"}' }}{% if not loop.last %}{{ ', ' }}{% else %}{{ ']' }}{% endif %}
{%- endfor %}{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ ' ' + m.content + eos_token }}
{%- elif m.role == 'tool' %}{{ '[TOOL_RESULTS] ' + m.content + '[/TOOL_RESULTS]' }}
{%- else %}{{ '[INST] ' + m.content + '[/INST]' }}{% endif %}{% endfor %}"""

# A format no named fallback describes (the derivation alone reads it): Llama 3.2 style
# custom calls, <function=NAME>ARGS</function>, the name outside the JSON, text before them.
FUNCTION_TAG = """\
{%- for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}
{%- if m.content %}{{ m.content }}{% endif %}
{%- if m.tool_calls %}{% if m.content %}{{ '\\n\\n' }}{% endif %}
{%- for c in m.tool_calls %}
{{- '<function=' + c.function.name + '>' + (c.function.arguments | tojson) + '</function>' }}
{%- endfor %}{% endif %}{{ '<|eot_id|>' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

TEMPLATES = {
    "radixlang": RADIXLANG,
    "hermes": HERMES,
    "llama3-json": LLAMA3_JSON,
    "mistral": MISTRAL,
    "function-tag": FUNCTION_TAG,
}


def JinjaChat(template: str) -> Any:
    """A template rendered as a tokenizer's ``apply_chat_template`` renders it."""
    return _JinjaTemplate(template, bos_token="<s>", eos_token="</s>")


def call_message(calls: list[tuple[str, Any, str]], content: str = "") -> dict[str, Any]:
    """An assistant message with ``calls`` (name, arguments, id)."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for n, a, i in calls
        ],
    }


# Qwen3: a reasoning model's; the last assistant turn after the user's question opens with its
# thinking block (empty when it has none), the calls after the content.
QWEN3 = """\
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for m in messages[::-1] %}{% set i = messages | length - 1 - loop.index0 %}
{%- if m.role == 'user' and ns.last_query == messages | length - 1 %}{% set ns.last_query = i %}
{%- endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{% set content = m.content or '' %}
{%- set reasoning = m.reasoning_content or '' %}
{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
{%- else %}{{ '<|im_start|>assistant\\n' + content }}{% endif %}
{%- for c in m.tool_calls or [] %}{% if (loop.first and content) or not loop.first %}
{{- '\\n' }}{% endif %}{% set f = c.function %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) }}
{{- '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}
{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
