"""The language's constructors: ``gen``, ``select``, roles, and the backend helpers.

Names, arguments and defaults follow SGLang's frontend language, so its programs run unchanged
with ``import radixlang as sgl``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixlang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlang.lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, RunTools, Select, as_expr
from radixlang.lang.run_options import get_default_backend
from radixlang.lang.structured import (
    check_ebnf,
    check_grammar,
    check_regex,
    only_one,
)
from radixlang.lang.structured import json_schema as structured_json_schema
from radixlang.lang.tools import DEFAULT_TIMEOUT_S, ToolResult, tool_choice_of, tools_by_name
from radixlang.sampling_fields import (
    FIELDS_BY_NAME,
    PROGRAM_FIELDS,
    SamplingParamsError,
    check_value,
    gen_arguments_help,
)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: Any = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | type | None = None,
    seed: int | None = None,
    ebnf: str | None = None,
    grammar: str | None = None,
    repetition_penalty: float | None = None,
    skip_special_tokens: bool | None = None,
    beam_width: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | None = None,
    thinking_budget: int | None = None,
    tools: Sequence[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    **sampling: Any,
) -> Expr:
    """Generate into variable ``name``. Unset arguments take the run's defaults (``run(...)``);
    ``choices=`` makes it a :func:`select`.

    The arguments up to ``json_schema`` are SGLang's ``gen``'s, in its order. The sampling ones
    mean what SGLang's sampling parameters of the same names mean, among them
    ``repetition_penalty`` (> 0; above 1 makes tokens already in the prompt or the output less
    likely, 1 leaves them be) and ``skip_special_tokens`` (False keeps special tokens such as
    ``<|im_end|>`` in the text; the default True drops them).

    Beam search: ``beam_width=k`` (> 1, with ``temperature=0``) keeps the k best sequences and
    returns the best, as transformers' ``num_beams``; ``length_penalty`` (default 1.0) divides
    a finished beam's summed log-probabilities by its length to that power, and
    ``early_stopping=True`` stops once k beams are finished.

    Reasoning models (a tokenizer with ``<think>`` / ``</think>`` tokens that its chat template
    writes): structured output holds the answer after the thinking, and ``thinking_budget=n``
    writes ``</think>`` after n thinking tokens, so the answer always comes.

    Tools: ``tools=[...]`` (Python functions, sync or async, whose signature and docstring
    make the tool's schema; pydantic model classes; :class:`~radixlang.lang.tools.Tool` objects,
    e.g. from an MCP server) lets the model call them. ``tool_choice``: ``"auto"`` (the
    default: the model answers in text or calls), ``"required"`` (it must call), ``"none"``
    (it may not), or one tool (its name): it must call that one. ``parallel_tool_calls=False``
    allows one call per answer. The calls are held to valid JSON arguments by a grammar on a
    radixlang backend (sent as ``tools`` to an OpenAI-compatible one); the tools are described
    once in the chat's system message. ``s.tool_calls(name)`` reads the calls and
    ``s += run_tools(name)`` runs them and appends their results as ``tool`` turns.

    Any other sampling field of ``radixlang.sampling_fields.SAMPLING_FIELDS`` is a keyword
    argument too (the table lists them all; see "Sampling arguments" below).

    Structured output (at most one of these, or ``dtype``/``choices``): ``regex=`` (the output
    fully matches it), ``json_schema=`` (a JSON-schema dict, its JSON text, or a pydantic model
    class: the output is compact JSON valid under it), ``grammar=`` (a Lark grammar with a
    ``start`` rule, llguidance's dialect) or ``ebnf=`` (SGLang's EBNF, ``root ::= ...``). Each is
    checked here, so a bad one raises :class:`~radixlang.lang.structured.StructuredOutputError`
    (a ``ValueError``) before anything runs. ``s[name]`` is the text; ``s.parsed(name)`` is the
    pydantic instance, the JSON value, or the ``dtype``'s value."""
    given = {**locals(), **sampling}  # the sampling arguments by gen()'s names
    unknown = sorted(set(sampling) - {f.gen for f in PROGRAM_FIELDS})
    if unknown:
        raise TypeError(f"gen() got an unexpected keyword argument {unknown[0]!r}")
    only_one(
        name,
        dict(regex=regex, json_schema=json_schema, grammar=grammar, ebnf=ebnf, dtype=dtype,
             choices=choices or None),
    )  # fmt: skip
    tool_list = list(tools_by_name(tools or []).values())
    try:
        tool_mode, callable_tools = tool_choice_of(tool_choice, tool_list)
    except ValueError as e:
        raise ValueError(f"gen({name!r}): {e}") from None
    if callable_tools:
        _check_tool_gen(name, tool_mode, n, choices, dict(regex=regex, json_schema=json_schema,
                        grammar=grammar, ebnf=ebnf, dtype=dtype))  # fmt: skip
    if choices:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    if stop_regex:
        raise ValueError("stop_regex is not supported: use stop strings or regex=")
    if regex is not None:
        check_regex(name, regex)
    schema = None if json_schema is None else structured_json_schema(name, json_schema)
    if grammar is not None:
        check_grammar(name, grammar)
    if ebnf is not None:
        check_ebnf(name, ebnf)
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"gen({name!r}): n must be a positive int, got {n!r}")
    if dtype is not None:
        from radixlang.constrain.dtypes import dtype_regex

        dtype_regex(dtype)  # unknown dtypes fail here, where the program names them
    values = {f.name: given[f.gen] for f in PROGRAM_FIELDS if given.get(f.gen) is not None}
    for key, value in values.items():
        if not FIELDS_BY_NAME[key].gen_checks:
            continue
        try:
            check_value(FIELDS_BY_NAME[key], value, python=True)
        except SamplingParamsError as e:
            raise ValueError(f"gen({name!r}): {e}") from None
    return Gen(
        name,
        values,
        n=n or 1,
        dtype=dtype,
        regex=regex,
        json_schema=schema,
        grammar=grammar,
        ebnf=ebnf,
        tools=callable_tools,
        shown_tools=tool_list if callable_tools else (),
        tool_mode=tool_mode,
        parallel_tool_calls=parallel_tool_calls,
    )


def _check_tool_gen(
    name: str | None, mode: str, n: int | None, choices: Any, constraints: dict[str, Any]
) -> None:
    """What a gen that may call tools cannot also be."""
    if choices:
        raise ValueError(f"gen({name!r}): tools= and choices= cannot be combined")
    for key, value in constraints.items():
        if value is not None and (key != "json_schema" or mode != "auto"):
            raise ValueError(
                f"gen({name!r}): tools= cannot be combined with {key}= (only tool_choice='auto' "
                "takes a json_schema=, for a reply that is not a call)"
            )
    if n is not None and n > 1:
        raise ValueError(f"gen({name!r}): tools= takes one output (n=1); fork for several")


def run_tools(name: str, timeout: float = DEFAULT_TIMEOUT_S) -> Expr:
    """Run the calls gen ``name`` wrote (with that gen's tools; several at once, async tools
    awaited) and append each result as a ``tool`` turn. A failing tool, one that takes more
    than ``timeout`` seconds, and a call of no such tool each become an error result the
    model reads; the program goes on. No calls: nothing is appended.
    ``s.tool_results(name)`` gives the results."""
    if not isinstance(name, str) or not name:
        raise ValueError("run_tools(name): the name of a gen that was given tools=")
    if not timeout > 0:
        raise ValueError(f"run_tools({name!r}): timeout must be seconds > 0, got {timeout!r}")
    return RunTools(name, timeout)


def tool(content: Any, call_id: str | None = None, name: str | None = None) -> ExprList:
    """A ``tool`` turn: a tool's result for the model, rendered by the chat template (a
    template without a tool role gets it as a user turn in ``<tool_response>`` tags).
    ``content`` may be a :class:`~radixlang.lang.tools.ToolResult`, which carries its call id
    and tool name."""
    if isinstance(content, ToolResult):
        call_id, name, content = call_id or content.call_id, name or content.name, content.content
    attrs = {k: v for k, v in (("tool_call_id", call_id), ("name", name)) if v}
    return ExprList([RoleBegin("tool", attrs), as_expr(content), RoleEnd("tool")])


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """Generate an integer (its text, e.g. ``"42"``)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """Generate a double-quoted string."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Choose one of ``choices`` (scored by the model as continuations of the text so far)."""
    if not choices:
        raise ValueError(f"select({name!r}) needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}): every choice must be a non-empty string")
    if temperature < 0:
        raise ValueError(f"select({name!r}): temperature must be >= 0")
    return Select(name, choices, temperature, choices_method)


def _role(role: str, expr: object | None) -> ExprList:
    inner = [] if expr is None else [as_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: object | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: object | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: object | None = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Flush the prefix cache of ``backend`` (the default one): True when it was flushed. A
    local ``Runtime`` raises ``CacheBusyError`` while requests are in flight; a server's
    ``RuntimeEndpoint`` answers False then, as SGLang's does."""
    backend = backend or get_default_backend()
    return bool(backend is not None and backend.flush_cache())


gen.__doc__ = (
    f"{gen.__doc__}\n\n    Sampling arguments (unset: the run's default):\n{gen_arguments_help()}\n"
)
