"""The sampling fields: one table, from which every layer takes its sampling vocabulary.

Each row is one knob in the engine's (SGLang's) name: its type, default, bounds and help text,
and under which name (if any) ``gen()``/``run()`` and OpenAI-style bodies take it. From this
table come ``runtime.sampling.SamplingParams`` (its fields and their checks),
``lang.ir.SamplingDefaults`` (a program run's defaults), ``gen()``'s keyword arguments and
their help, the OpenAI server's body fields, ``/generate``'s OpenAPI schema of
``sampling_params``, and what the OpenAI backend sends. A new knob is one row here (plus what
the sampler does with it).

Torch-free, and it imports no layer: the language and the server read it without the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Inclusive range torch.Generator.manual_seed accepts.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; the message names the field."""


# A field's kind: the Python type of its values, as a dataclass annotation and for checks.
KINDS: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "seed": int | None,  # an int in [SEED_MIN, SEED_MAX], or None: a fresh draw
    "stop": list[str],  # a str or a list of str in; a list out
    "token_ids": list[int],
    "text": str | None,
    "schema": str | dict | None,  # a JSON schema: a dict or its JSON text
    "logit_bias": dict[int, float] | None,
}


@dataclass(frozen=True)
class SamplingField:
    """One sampling knob."""

    name: str  # the engine's name (SGLang's sampling_params key)
    kind: str  # one of KINDS
    default: Any  # the engine's default (a list default is copied per request)
    help: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # minimum itself is not allowed
    rule: str | None = None  # how the allowed values read in an error, where bounds say less
    gen: str | None = None  # the gen()/run() keyword; None: not a program sampling argument
    # Programs: when neither the gen nor the run gives it, leave it out of the request (the
    # backend's own default applies) instead of sending ``default``.
    omit_unset: bool = False
    # gen() checks the value where the program names it; the others reach the backend as given
    # and are its to refuse (a server answers 400, which the program sees as its error).
    gen_checks: bool = False
    openai: str | None = None  # the name in OpenAI-style bodies; None: not taken as is
    openai_official: bool = False  # OpenAI's own API has it (else a vLLM/SGLang extra)

    @property
    def annotation(self) -> Any:
        return KINDS[self.kind]

    def describe(self) -> str:
        """The values allowed, as an error message says them (``must be ...``)."""
        if self.rule is not None:
            return self.rule
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return f"in {'(' if self.exclusive_minimum else '['}{_num(low)}, {_num(high)}]"
        if low is not None:
            finite = "finite and " if self.kind == "float" else ""
            return f"{finite}{'>' if self.exclusive_minimum else '>='} {_num(low)}"
        return "finite" if self.kind == "float" else f"a {self.kind}"

    def allows(self, value: float) -> bool:
        low, high = self.minimum, self.maximum
        if self.kind == "float" and not math.isfinite(value):
            return False
        if low is not None and (value <= low if self.exclusive_minimum else value < low):
            return False
        return high is None or value <= high


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_STRUCTURED = "structured output (at most one of regex, json_schema, ebnf, grammar)"

# SGLang's gen() order first, then radixlang's; SamplingParams' fields in this order.
SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_new_tokens", "int", 128,
                  "the most tokens to generate (0: prefill only); unset, the default is cut "
                  "to what the context has left", minimum=0, gen="max_tokens", omit_unset=True),
    SamplingField("min_new_tokens", "int", 0,
                  "EOS and stop tokens are masked until this many tokens were generated",
                  minimum=0, gen="min_tokens", openai="min_tokens"),
    SamplingField("temperature", "float", 1.0, "0: greedy", minimum=0, gen="temperature",
                  openai="temperature", openai_official=True),
    SamplingField("top_p", "float", 1.0, "nucleus sampling: the smallest set of tokens "
                  "holding this much probability", minimum=0, maximum=1,
                  exclusive_minimum=True, gen="top_p", openai="top_p", openai_official=True),
    SamplingField("top_k", "int", -1, "sample among the k likeliest tokens (-1 or 0: off)",
                  minimum=-1, rule="-1 (off), 0 (off) or > 0", gen="top_k", openai="top_k"),
    SamplingField("min_p", "float", 0.0,
                  "drop tokens less likely than this fraction of the likeliest one",
                  minimum=0, maximum=1, gen="min_p", openai="min_p"),
    SamplingField("repetition_penalty", "float", 1.0,
                  "over prompt and output tokens, a positive logit is divided by it and a "
                  "negative one multiplied (1: none)", minimum=0, exclusive_minimum=True,
                  rule="a finite number > 0 (1 is none)", gen="repetition_penalty",
                  omit_unset=True, gen_checks=True, openai="repetition_penalty"),
    SamplingField("frequency_penalty", "float", 0.0,
                  "subtracted from a token's logit once per time it was generated",
                  minimum=-2, maximum=2, gen="frequency_penalty", openai="frequency_penalty",
                  openai_official=True),
    SamplingField("presence_penalty", "float", 0.0,
                  "subtracted from the logit of every token generated at least once",
                  minimum=-2, maximum=2, gen="presence_penalty", openai="presence_penalty",
                  openai_official=True),
    SamplingField("seed", "seed", None,
                  "a request's own sampling seed: the same tokens alone or in any batch",
                  minimum=SEED_MIN, maximum=SEED_MAX, gen="seed", omit_unset=True,
                  openai="seed", openai_official=True),
    SamplingField("stop", "stop", [], "stop strings (a str or a list); not in the output",
                  gen="stop", openai="stop", openai_official=True),
    SamplingField("stop_token_ids", "token_ids", [], "token ids that end the output",
                  gen="stop_token_ids", openai="stop_token_ids"),
    SamplingField("ignore_eos", "bool", False, "go on past the end-of-sequence token",
                  gen="ignore_eos", openai="ignore_eos"),
    SamplingField("skip_special_tokens", "bool", True,
                  "leave special tokens such as <|im_end|> out of the text",
                  gen="skip_special_tokens", omit_unset=True, gen_checks=True,
                  openai="skip_special_tokens"),
    SamplingField("return_logprob", "bool", False, "report the output tokens' logprobs",
                  gen="return_logprob"),
    SamplingField("top_logprobs_num", "int", 0, "and this many likeliest tokens' at each",
                  minimum=0, gen="top_logprobs_num"),
    SamplingField("logprob_start_len", "int", -1,
                  "report prompt logprobs from this position (-1: none)", minimum=-1,
                  rule="-1 (off) or >= 0", gen="logprob_start_len"),
    SamplingField("regex", "text", None, f"{_STRUCTURED}: the output fully matches it",
                  openai="regex"),
    SamplingField("json_schema", "schema", None,
                  f"{_STRUCTURED}: the output is JSON valid under it"),
    SamplingField("ebnf", "text", None, f"{_STRUCTURED}: a grammar, SGLang's EBNF",
                  openai="ebnf"),
    SamplingField("grammar", "text", None, f"{_STRUCTURED}: a grammar, Lark syntax"),
    SamplingField("token_healing", "bool", False,
                  "text prompts: back up over a last token that longer tokens start with, "
                  "and make the first output token start with its text"),
    SamplingField("logit_bias", "logit_bias", None,
                  "OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit",
                  openai="logit_bias", openai_official=True),
    SamplingField("beam_width", "int", 1,
                  "beam search: keep this many best sequences, return the best (1: off; "
                  "with temperature 0)", minimum=1, rule=">= 1 (1: off)", gen="beam_width",
                  omit_unset=True, openai="beam_width"),
    SamplingField("length_penalty", "float", 1.0,
                  "beam search: a finished beam scores sum(logprobs) / length ** this",
                  gen="length_penalty", omit_unset=True, openai="length_penalty"),
    SamplingField("early_stopping", "bool", False,
                  "beam search: stop once beam_width sequences are finished",
                  gen="early_stopping", omit_unset=True, openai="early_stopping"),
    SamplingField("thinking_budget", "int", -1,
                  "reasoning models: at most this many thinking tokens, then </think> is "
                  "written and the answer follows (-1: no limit)", minimum=-1,
                  rule=">= -1 (-1: no limit)", gen="thinking_budget", omit_unset=True,
                  openai="thinking_budget"),
)  # fmt: skip
FIELDS_BY_NAME = {f.name: f for f in SAMPLING_FIELDS}
# The structured-output fields, each a kind radixlang.constrain compiles.
STRUCTURED_OUTPUT = ("regex", "json_schema", "ebnf", "grammar")
# The fields a program's gen() and run() take as sampling arguments (gen's names differ for
# max_new_tokens and min_new_tokens); the structured-output ones are gen()'s own arguments.
PROGRAM_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.gen is not None)


def _type_name(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def check_value(field: SamplingField, value: Any, *, python: bool = False) -> Any:
    """``value`` checked against ``field``'s kind and bounds, normalised (numbers to the kind's
    type, a stop string to a list, ``top_k`` 0 to -1); raises :class:`SamplingParamsError`
    naming the field. ``python``: a bool's error says ``True or False`` (the language), not
    ``a bool`` (JSON requests)."""
    name, kind = field.name, field.kind
    if kind == "bool":
        if not isinstance(value, bool):
            what = "True or False" if python else "a bool"
            raise SamplingParamsError(f"{name} must be {what}, got {_type_name(value)}")
        return value
    if kind in ("int", "seed"):
        if kind == "seed" and value is None:
            return None
        # bool is an int subclass, but True as max_new_tokens is a caller bug, not a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise SamplingParamsError(f"{name} must be an int, got {_type_name(value)}")
        if not field.allows(value):
            raise SamplingParamsError(f"{name} must be {field.describe()}, got {value}")
        return -1 if name == "top_k" and value == 0 else value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            what = field.rule or "a number"
            raise SamplingParamsError(f"{name} must be {what}, got {_type_name(value)}")
        if not field.allows(value):  # NaN is never allowed
            raise SamplingParamsError(f"{name} must be {field.describe()}, got {value}")
        return float(value)
    if kind == "stop":
        return _stop_strings(value)
    if kind == "token_ids":
        return _token_ids(name, value)
    if kind == "text":
        if value is not None and not isinstance(value, str):
            raise SamplingParamsError(f"{name} must be a str or None, got {_type_name(value)}")
        return value
    if kind == "schema":
        if value is not None and not isinstance(value, str | dict):
            raise SamplingParamsError(
                f"{name} must be a JSON-schema object or its JSON text, got {type(value).__name__}"
            )
        return value
    if kind == "logit_bias":
        return _logit_bias(value)
    raise AssertionError(f"unknown sampling field kind {kind!r}")


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple):
        raise SamplingParamsError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise SamplingParamsError(f"stop entries must be str, got {_type_name(s)}")
        if not s:
            # An empty stop string would match at every position and end every request.
            raise SamplingParamsError("stop entries must be non-empty strings")
    return list(stop)


def _token_ids(name: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple | set | frozenset):
        raise SamplingParamsError(f"{name} must be a list of int, got {type(ids).__name__}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise SamplingParamsError(f"{name} entry must be an int, got {_type_name(i)}")
        if i < 0:
            raise SamplingParamsError(f"{name} entries must be >= 0, got {i}")
    return list(ids)


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, Mapping):
        raise SamplingParamsError(
            f"logit_bias must map token ids to numbers, got {type(bias).__name__}"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SamplingParamsError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SamplingParamsError(
                f"logit_bias[{key}] must be a number, got {_type_name(value)}"
            )
        if not -100 <= value <= 100:  # also rejects NaN
            raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


def gen_arguments_help() -> str:
    """The sampling arguments of ``gen()`` and ``run()``, one line each (for their docs)."""
    lines = []
    for f in PROGRAM_FIELDS:
        lines.append(f"    {f.gen}: {f.help} (default {f.default!r})")
    return "\n".join(lines)
