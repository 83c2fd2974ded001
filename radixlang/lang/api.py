"""The language's constructors: ``gen``, ``select``, roles, and the backend helpers.

Names, arguments and defaults follow SGLang's frontend language, so its programs run unchanged
with ``import radixlang as sgl``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixlang.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlang.lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, as_expr
from radixlang.lang.run_options import get_default_backend
from radixlang.lang.structured import (
    check_ebnf,
    check_grammar,
    check_regex,
    only_one,
)
from radixlang.lang.structured import json_schema as structured_json_schema
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
    values = {f.name: given[f.gen] for f in PROGRAM_FIELDS if given[f.gen] is not None}
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
    )


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
