"""Grammar engines side by side on one tokenizer: llguidance, xgrammar, the old regex automaton.

One command:  .venv/bin/python benchmarks/bench_grammar_engines.py [--quick]
Writes benchmarks/results/bench_grammar_engines.json and .png.

radixlang constrains output with llguidance (``radixlang.constrain.grammar``): one library for
regex, JSON schema, Lark and EBNF. This measures that choice against xgrammar (the engine SGLang
and vLLM default to) and against the hand-written regex automaton it replaced
(``benchmarks/regex_automaton.py``, regex only), on the default model's tokenizer (SmolLM2,
49,152 tokens), in one process:

- constraints: JSON schemas (flat, nested, bounded arrays, enums, anyOf, $ref with recursion, the
  invoice schema of bench_structured.py), regexes, and two grammars written in Lark (for
  llguidance) and in the equivalent GBNF/EBNF (for xgrammar);
- compile time, cold (median of ``--compile-repeats``; xgrammar's compiler cache off, the regex
  automaton built anew), and for llguidance also through radixlang's ``compile_grammar`` (which
  checks the schema or grammar first);
- a fresh matcher per request (llguidance: a copy of the compiled template, as the engine does);
- the token mask per step along a real walk: each matcher is driven with the tokens of valid
  outputs (``json.dumps`` of valid instances, valid strings of the regex or grammar, then EOS),
  and the mask is timed at every step, at batch 1 (the single-matcher call) and at batch 32
  (the batch calls: llguidance's executor, xgrammar's ``BatchGrammarMatcher``, both with
  ``--threads`` threads; for the regex automaton one cached mask per row, stacked). ``fill``:
  the engine's native mask (packed bits; bool rows for the regex automaton); ``bool``: fill plus
  unpacking to the bool rows radixlang's sampler takes. The first walk after compiling is
  reported apart (lazy work: llguidance's lexer, the automaton's per-state masks); the p50/p99
  are of later, warm walks. Every mask is checked to allow the walk's next token;
- jump-forward: the text forced at the start (``{"name": "``), and a simulated decode of the
  first example in which forced tokens are appended without a model step: model steps with
  jump-forward against the example's token count;
- coverage: small JSON schemas, regexes and grammars that each use one feature; per engine,
  whether it compiles, accepts a valid output and rejects an invalid one (an engine that compiles
  a schema but ignores a keyword accepts the invalid output).

Ratios are what to read: the machines are shared and noisy (load averages are in the JSON).
``--quick``: a few constraints, batch 1 and 4, one repeat (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlang.model_files import DEFAULT_MODEL, load_model_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_structured
from provenance import provenance

# As radixlang.constrain.grammar compiles JSON schemas for llguidance: json.dumps's layout.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
XGRAMMAR_JSON = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": True}


# ---- the constraints -------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "json_schema", "regex" or "grammar" (Lark, with ``ebnf`` its GBNF twin)
    source: Any
    examples: tuple[str, ...]  # valid outputs, walked token by token
    ebnf: str | None = None


def json_case(name: str, schema: dict[str, Any], instances: Sequence[Any]) -> Case:
    import jsonschema

    for value in instances:
        jsonschema.validate(value, schema)
    return Case(name, "json_schema", schema, tuple(json.dumps(v) for v in instances))


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


FLAT = obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 150}, email=S, is_member=B)
NESTED = obj(
    order_id=S,
    customer=obj(
        name=S, address=obj(street=S, city=S, zip={"type": "string", "pattern": "^[0-9]{5}$"})
    ),
    total=N,
)
ARRAYS = obj(
    tags={"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1,
          "maxItems": 5},
    scores={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 2, "maxItems": 4},
    matrix={"type": "array", "items": {"type": "array", "items": N, "maxItems": 3},
            "maxItems": 3},
)  # fmt: skip
ENUMS = obj(
    status={"enum": ["pending", "shipped", "delivered", "cancelled"]},
    priority={"enum": [1, 2, 3]},
    channel={"type": "string", "enum": ["email", "phone", "chat"]},
    version={"const": "v2"},
)
ANY_OF = obj(
    contact={
        "anyOf": [
            obj(email=S),
            obj(phone={"type": "string", "pattern": "^\\+[0-9]{6,12}$"}),
        ]
    },
    value={"anyOf": [S, INT, {"type": "null"}]},
)
REF = {
    "$defs": {
        "node": obj(label=S, children={"type": "array", "items": {"$ref": "#/$defs/node"},
                                       "maxItems": 3}),
        "point": obj(x=N, y=N),
    },
    **obj(origin={"$ref": "#/$defs/point"}, tree={"$ref": "#/$defs/node"}),
}  # fmt: skip

SQL_LARK = r"""
start: "SELECT " columns " FROM " NAME where? ";"
columns: NAME (", " NAME)*
where: " WHERE " condition (" AND " condition)*
condition: NAME " " OP " " value
OP: "<=" | ">=" | "=" | "<" | ">"
value: NUMBER | STRING
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+/
STRING: /'[a-z ]*'/
"""
SQL_EBNF = r"""
root ::= "SELECT " columns " FROM " name where? ";"
columns ::= name (", " name)*
where ::= " WHERE " condition (" AND " condition)*
condition ::= name " " op " " value
op ::= "<=" | ">=" | "=" | "<" | ">"
value ::= number | string
name ::= [a-z_] [a-z0-9_]*
number ::= [0-9]+
string ::= "'" [a-z ]* "'"
"""
ARITH_LARK = r"""
start: expr
expr: term (ADD term)*
term: factor (MUL factor)*
factor: NUMBER | "(" expr ")" | "-" factor
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""


def all_cases() -> list[Case]:
    invoice = bench_structured.make_documents(3)
    return [
        json_case("flat", FLAT, [
            {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "is_member": True},
            {"name": "Alan Turing", "age": 41, "email": "alan@example.org", "is_member": False},
            {"name": "Grace Hopper", "age": 85, "email": "grace@navy.mil", "is_member": True},
        ]),
        json_case("nested", NESTED, [
            {"order_id": "A-1029", "customer": {"name": "Lin Wei", "address": {
                "street": "12 Harbour Lane", "city": "Galway", "zip": "09127"}}, "total": 129.5},
            {"order_id": "B-77", "customer": {"name": "Sam Okafor", "address": {
                "street": "5 Via Roma", "city": "Bologna", "zip": "40121"}}, "total": 18},
        ]),
        json_case("arrays", ARRAYS, [
            {"tags": ["red", "sale", "new"], "scores": [90, 75, 60],
             "matrix": [[1.5, 2], [3, 4.25]]},
            {"tags": ["x"], "scores": [1, 2], "matrix": []},
        ]),
        json_case("enums", ENUMS, [
            {"status": "shipped", "priority": 2, "channel": "email", "version": "v2"},
            {"status": "cancelled", "priority": 3, "channel": "chat", "version": "v2"},
        ]),
        json_case("any_of", ANY_OF, [
            {"contact": {"email": "kim@example.com"}, "value": 42},
            {"contact": {"phone": "+3531234567"}, "value": "pending"},
            {"contact": {"email": "x@y.z"}, "value": None},
        ]),
        json_case("ref_recursive", REF, [
            {"origin": {"x": 0, "y": 1.5}, "tree": {"label": "root", "children": [
                {"label": "a", "children": []},
                {"label": "b", "children": [{"label": "c", "children": []}]}]}},
            {"origin": {"x": -2, "y": 3}, "tree": {"label": "leaf", "children": []}},
        ]),
        json_case("invoice", bench_structured.SCHEMA, [truth for _, truth in invoice]),
        Case("phone", "regex", r"\(\d{3}\) \d{3}-\d{4}", ("(555) 123-4567", "(020) 794-0000")),
        Case("email", "regex", r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,20}\.(com|org|net|io)",
             ("jane.doe@example.com", "ops+alerts@radix-lang.io")),
        Case("iso_datetime", "regex",
             r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\dZ",
             ("2024-03-09T14:05:59Z", "1999-12-31T23:59:00Z")),
        Case("ipv4", "regex",
             r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
             ("192.168.0.1", "10.254.33.7")),
        Case("json_like_regex", "regex",
             r'\{"name": "[A-Za-z ]{1,24}", "age": (0|[1-9]\d{0,2}), "city": "[A-Za-z ]{1,24}"\}',
             ('{"name": "Ada Lovelace", "age": 36, "city": "London"}',
              '{"name": "Kwame Osei", "age": 7, "city": "Accra"}')),
        Case("sql_select", "grammar", SQL_LARK, (
            "SELECT name, age FROM users WHERE age >= 18 AND city = 'paris';",
            "SELECT id FROM orders;",
            "SELECT total, customer_id FROM invoices WHERE total > 100;"), ebnf=SQL_EBNF),
        Case("arithmetic", "grammar", ARITH_LARK,
             ("(12+3.5)*4-5/6", "-(7*(2+3))/10", "1+2+3*4-(5-6)"), ebnf=ARITH_EBNF),
    ]  # fmt: skip


QUICK_CASES = ("flat", "ref_recursive", "phone", "sql_select")


# Feature probes: (name, kind, source, a valid output, an invalid output); kind "lark"/"ebnf"
# are grammars in that syntax.
COVERAGE: list[tuple[str, str, Any, str, str]] = [
    ("string_pattern", "json_schema", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
     '"ABC-12"', '"abc-12"'),
    ("string_min_max_length", "json_schema", {"type": "string", "minLength": 2, "maxLength": 4},
     '"abc"', '"abcdef"'),
    ("format_date", "json_schema", {"type": "string", "format": "date"},
     '"2024-01-31"', '"yesterday"'),
    ("format_date_time", "json_schema", {"type": "string", "format": "date-time"},
     '"2024-01-31T10:00:00Z"', '"soon"'),
    ("format_email", "json_schema", {"type": "string", "format": "email"},
     '"a@example.com"', '"not an email"'),
    ("format_uuid", "json_schema", {"type": "string", "format": "uuid"},
     '"123e4567-e89b-12d3-a456-426614174000"', '"1234"'),
    ("integer_bounds", "json_schema", {"type": "integer", "minimum": 10, "maximum": 20},
     "15", "25"),
    ("number_exclusive_bounds", "json_schema",
     {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "0.5", "0"),
    ("multiple_of", "json_schema", {"type": "integer", "multipleOf": 5}, "15", "7"),
    ("enum_mixed_types", "json_schema", {"enum": ["a", 1, None]}, "1", "2"),
    ("const", "json_schema", {"const": "fixed"}, '"fixed"', '"other"'),
    ("array_min_max_items", "json_schema",
     {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     "[1, 2]", "[1]"),
    ("unique_items", "json_schema", {"type": "array", "items": {"type": "integer"},
                                     "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    ("prefix_items_tuple", "json_schema",
     {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     '["a", 1]', '[1, "a"]'),
    ("contains", "json_schema", {"type": "array", "items": {"type": "integer"},
                                 "contains": {"const": 7}}, "[1, 7]", "[1, 2]"),
    ("any_of", "json_schema", {"anyOf": [{"type": "string"}, {"type": "integer"}]},
     "3", "true"),
    ("one_of", "json_schema", {"oneOf": [{"type": "string"}, {"type": "integer"}]},
     '"x"', "null"),
    ("all_of_objects", "json_schema",
     {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}},
                 "required": ["b"]}]},
     '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("ref_defs", "json_schema",
     {"$defs": {"n": {"type": "integer", "minimum": 0}}, "type": "array",
      "items": {"$ref": "#/$defs/n"}}, "[0, 3]", "[-1]"),
    ("ref_recursive", "json_schema",
     {"$defs": {"node": obj(label=S, children={"type": "array",
                                               "items": {"$ref": "#/$defs/node"}})},
      "$ref": "#/$defs/node"},
     '{"label": "a", "children": [{"label": "b", "children": []}]}',
     '{"label": "a", "children": [{"label": 1, "children": []}]}'),
    ("additional_properties_schema", "json_schema",
     {"type": "object", "additionalProperties": {"type": "integer"}}, '{"x": 1}', '{"x": "a"}'),
    ("pattern_properties", "json_schema",
     {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
      "additionalProperties": False}, '{"n_a": 1}', '{"m": 1}'),
    ("optional_properties", "json_schema",
     {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "required": ["a"]}, '{"a": 1}', '{"b": 1}'),
    ("min_max_properties", "json_schema",
     {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1,
      "maxProperties": 2}, '{"a": 1}', "{}"),
    ("nullable_type_list", "json_schema", {"type": ["string", "null"]}, "null", "1"),
    ("not", "json_schema", {"type": "integer", "not": {"const": 3}}, "4", "3"),
    ("if_then_else", "json_schema",
     {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}}, "15", "25"),
    ("dependent_required", "json_schema",
     {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     '{"a": 1, "b": 2}', '{"a": 1}'),
    ("regex_plain", "regex", r"[a-z]+-\d{2}", "ab-12", "AB-12"),
    ("regex_anchors", "regex", r"^\d{3}$", "123", "1234"),
    ("regex_lookahead", "regex", r"(?=\d)\w{3}", "1ab", "abc"),
    ("regex_backreference", "regex", r"(a|b)\1", "aa", "ab"),
    ("regex_lazy_quantifier", "regex", r"a+?b", "aab", "ba"),
    ("regex_non_ascii", "regex", "caf[éè] crème", "café crème", "cafe creme"),
    ("regex_case_insensitive_flag", "regex", "(?i)abc", "ABC", "abd"),
    ("regex_unicode_word", "regex", r"\w+", "naïve", "a b"),
    ("lark_sql", "lark", SQL_LARK, "SELECT a FROM t;", "SELECT FROM t;"),
    ("lark_arithmetic", "lark", ARITH_LARK, "(1+2)*3", "(1+2"),
    ("lark_json_extension", "lark", 'start: "x=" %json {"type": "integer"}', "x=5", 'x="5"'),
    ("ebnf_sql", "ebnf", SQL_EBNF, "SELECT a FROM t;", "SELECT FROM t;"),
    ("ebnf_arithmetic", "ebnf", ARITH_EBNF, "(1+2)*3", "(1+2"),
]  # fmt: skip


# ---- the engines -----------------------------------------------------------------------------
class Unsupported(Exception):
    """The engine has no compiler for this kind of constraint."""


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Adapter:
    """One grammar engine behind a common interface (compile, new matcher, fill a batch of
    masks, advance, forced text), so every engine goes through the same measurements."""

    name: str
    version: str
    setup_ms: float = 0.0
    packed: bool = True  # fills packed bitmasks (else returns bool rows)
    notes: list[str] = field(default_factory=list)

    def compile(self, kind: str, source: Any) -> Any:
        raise NotImplementedError

    def new_matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def advance(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def forced(self, matcher: Any) -> tuple[bytes, list[int]] | None:
        """(forced bytes, forced tokens) from here, or None without jump-forward support."""
        return None


class LLGuidance(Adapter):
    def __init__(self, tokenizer: Any, vocab: int, eos: list[int], threads: int) -> None:
        import llguidance

        from radixlang.constrain import clear_grammar_cache
        from radixlang.constrain.grammar import closed_objects, ll_tokenizer

        super().__init__("llguidance", metadata.version("llguidance"))
        self.lib, self.closed_objects = llguidance, closed_objects
        clear_grammar_cache()
        start = time.perf_counter()
        self.ll = ll_tokenizer(tokenizer, vocab, eos)
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.row_bytes = (vocab + 31) // 32 * 4

    def grammar(self, kind: str, source: Any, closed: bool = True) -> str:
        m = self.lib.LLMatcher
        if kind == "json_schema":
            # Objects closed to unlisted keys, as radixlang does (xgrammar's strict mode).
            text = json.dumps(self.closed_objects(source) if closed else source)
            return m.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        if kind == "regex":
            return m.grammar_from_regex(source)
        if kind in ("grammar", "lark"):
            return m.grammar_from_lark(source)
        if kind == "ebnf":
            return self.lib.grammar_from("ebnf", source)
        raise Unsupported(kind)

    def compile(self, kind: str, source: Any, closed: bool = True) -> Any:
        matcher = self.lib.LLMatcher(self.ll, self.grammar(kind, source, closed), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), self.row_bytes)
        else:
            self.executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)],
                bitmask.data_ptr(),
                self.row_bytes,
                bitmask.shape[0],
            )
        return None

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def forced(self, matcher: Any) -> tuple[bytes, list[int]]:
        return bytes(matcher.compute_ff_bytes()), list(matcher.compute_ff_tokens())


class XGrammar(Adapter):
    def __init__(self, tokenizer: Any, vocab: int, eos: list[int], threads: int) -> None:
        import xgrammar

        super().__init__("xgrammar", metadata.version("xgrammar"))
        self.lib = xgrammar
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=eos
        )
        self.setup_ms = (time.perf_counter() - start) * 1e3
        # No cache: every compile is cold. Its default 8 compile threads.
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.notes.append("GrammarCompiler(max_threads=8 (default), cache_enabled=False)")

    def compile(self, kind: str, source: Any) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(source), **XGRAMMAR_JSON)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "ebnf":
            return self.compiler.compile_grammar(source)
        if kind == "lark":
            return self.compiler.compile_lark(source)
        raise Unsupported(kind)

    def new_matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        return None

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def forced(self, matcher: Any) -> tuple[bytes, list[int]]:
        return (
            matcher.find_jump_forward_string().encode(),
            list(matcher.find_jump_forward_tokens()),
        )


class RegexAutomaton(Adapter):
    """radixlang's previous engine: interegular's automaton, per-state masks over a token trie."""

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int], threads: int) -> None:
        from radixlang.constrain import clear_vocabulary_cache, token_vocabulary

        super().__init__("regex_automaton", "radixlang", packed=False)
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, eos
        clear_vocabulary_cache()
        start = time.perf_counter()
        token_vocabulary(tokenizer, vocab)
        self.setup_ms = (time.perf_counter() - start) * 1e3

    def compile(self, kind: str, source: Any) -> Any:
        from regex_automaton import RegexGuide  # beside this file

        from radixlang.constrain import ConstraintError

        if kind != "regex":
            raise Unsupported(kind)
        try:
            return RegexGuide(source, self.tokenizer, self.eos, self.vocab)
        except ConstraintError as e:
            raise ValueError(str(e)) from None

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.new_constraint()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> torch.Tensor:
        if len(matchers) == 1:
            return matchers[0].allowed_mask().unsqueeze(0)
        # Its cached rows gathered by numpy: torch.stack waits on torch's thread team, tens of
        # milliseconds on a busy machine (measured), which is not the automaton's cost.
        return torch.from_numpy(np.stack([m.allowed_mask().numpy() for m in matchers]))

    def advance(self, matcher: Any, token: int) -> bool:
        from radixlang.constrain import ConstraintError

        try:
            matcher.advance(token)
        except ConstraintError:
            return False
        return True


ENGINES: dict[str, Callable[..., Adapter]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "regex_automaton": RegexAutomaton,
}


def case_source(adapter: Adapter, case: Case) -> tuple[str, Any]:
    """The (kind, source) ``adapter`` compiles for ``case``: xgrammar gets a grammar as EBNF."""
    if case.kind == "grammar":
        return ("ebnf", case.ebnf) if adapter.name == "xgrammar" else ("lark", case.source)
    return case.kind, case.source


# ---- measurements ----------------------------------------------------------------------------
def ms_since(start: int) -> float:
    return (time.perf_counter_ns() - start) / 1e6


def walk(
    adapter: Adapter,
    compiled: Any,
    rows: list[list[int]],
    bitmask: torch.Tensor,
    vocab: int,
) -> dict[str, Any]:
    """Drive one fresh matcher per row through its tokens; time each step's masks for all rows
    still going (fill, and fill + unpack to bool), and check each allows the row's token."""
    from radixlang.constrain.grammar import unpack_bits

    matchers = [adapter.new_matcher(compiled) for _ in rows]
    fill_ms: list[float] = []
    bool_ms: list[float] = []
    advance_us: list[float] = []
    rejected: list[dict[str, Any]] = []
    active = [i for i in range(len(rows)) if rows[i]]
    step = 0
    while active:
        batch = [matchers[i] for i in active]
        start = time.perf_counter_ns()
        masks = adapter.fill(batch, bitmask)
        fill_ms.append(ms_since(start))
        if masks is None:
            masks = unpack_bits(bitmask[: len(batch)].view(torch.uint8), vocab)
        bool_ms.append(ms_since(start))
        allowed = masks[torch.arange(len(active)), [rows[i][step] for i in active]].tolist()
        still = []
        for i, ok in zip(active, allowed, strict=True):
            token = rows[i][step]
            start = time.perf_counter_ns()
            taken = ok and adapter.advance(matchers[i], token)
            advance_us.append((time.perf_counter_ns() - start) / 1e3)
            if not taken:
                rejected.append({"row": i, "step": step, "token": token, "in_mask": bool(ok)})
            elif step + 1 < len(rows[i]):
                still.append(i)
        active = still
        step += 1
    return {"fill_ms": fill_ms, "bool_ms": bool_ms, "advance_us": advance_us, "rejected": rejected}


def walk_stats(walks: list[dict[str, Any]]) -> dict[str, Any]:
    fill = [t for w in walks for t in w["fill_ms"]]
    bools = [t for w in walks for t in w["bool_ms"]]
    adv = [t for w in walks for t in w["advance_us"]]
    return {
        "steps": len(fill),
        "fill_ms_p50": _percentile(fill, 0.5),
        "fill_ms_p99": _percentile(fill, 0.99),
        "bool_ms_p50": _percentile(bools, 0.5),
        "bool_ms_p99": _percentile(bools, 0.99),
        "fill_ms_total": sum(fill),
        "advance_us_p50": _percentile(adv, 0.5),
        "rejected_tokens": sum(len(w["rejected"]) for w in walks),
        "first_rejections": [r for w in walks for r in w["rejected"]][:3],
    }


def simulate_jump_forward(
    adapter: Adapter, compiled: Any, text: str, tokenizer: Any, token_bytes: Callable[[int], bytes]
) -> dict[str, Any]:
    """Decode ``text`` as a model would that picks its tokens (the tokenizer's first token of
    what is left), appending the engine's forced tokens without a model step where it has any.
    """
    matcher = adapter.new_matcher(compiled)
    first = adapter.forced(matcher)
    if first is None:
        return {"supported": False}
    data, pos, sampled, forced, jumps = text.encode(), 0, 0, 0, 0
    plain = len(tokenizer.encode(text, add_special_tokens=False))
    while pos < len(data):
        result = adapter.forced(matcher)
        assert result is not None
        _, tokens = result
        if tokens:
            got = b"".join(token_bytes(t) for t in tokens)
            if data[pos : pos + len(got)] != got or not all(
                adapter.advance(matcher, t) for t in tokens
            ):
                return {"supported": True, "diverged_at_byte": pos, "forced": got.decode("latin1")}
            pos, forced, jumps = pos + len(got), forced + len(tokens), jumps + 1
            if pos >= len(data):
                break
        token = tokenizer.encode(data[pos:].decode(), add_special_tokens=False)[0]
        if not adapter.advance(matcher, token):
            return {"supported": True, "rejected_at_byte": pos, "token": token}
        pos, sampled = pos + len(token_bytes(token)), sampled + 1
    return {
        "supported": True,
        "initial_forced_text": first[0].decode("utf-8", "replace"),
        "initial_forced_tokens": len(first[1]),
        "example_tokens": plain,
        "model_steps_with_jump_forward": sampled,
        "forced_tokens": forced,
        "jumps": jumps,
        "model_steps_cut": 1 - sampled / plain,
    }


def bench_case(
    adapter: Adapter,
    case: Case,
    tokenizer: Any,
    vocab: int,
    eos: int,
    token_bytes: Callable[[int], bytes],
    args: argparse.Namespace,
) -> dict[str, Any]:
    kind, source = case_source(adapter, case)
    entry: dict[str, Any] = {"compiled_as": kind}
    cold = []
    try:
        for _ in range(args.compile_repeats):
            start = time.perf_counter_ns()
            compiled = adapter.compile(kind, source)
            cold.append(ms_since(start))
    except Unsupported:
        return {"supported": False, "compiled_as": kind}
    except Exception as e:
        return {"supported": True, "compiled_as": kind, "error": f"{type(e).__name__}: {e}"[:300]}
    entry["compile_ms"] = statistics.median(cold)
    entry["compile_ms_all"] = cold
    if adapter.name == "llguidance":
        entry["radixlang_compile_ms"] = radixlang_compile_ms(
            case, tokenizer, vocab, eos, args.compile_repeats
        )
    news = []
    for _ in range(20):
        start = time.perf_counter_ns()
        adapter.new_matcher(compiled)
        news.append((time.perf_counter_ns() - start) / 1e3)
    entry["fresh_matcher_us"] = statistics.median(news)

    rows = [[*tokenizer.encode(text, add_special_tokens=False), eos] for text in case.examples]
    bitmask = torch.zeros((max(args.batches), (vocab + 31) // 32), dtype=torch.int32)
    # The first walks after compiling: lazy work (lexer states, per-state masks) included.
    first = [walk(adapter, compiled, [r], bitmask, vocab) for r in rows]
    entry["first_walk"] = walk_stats(first)
    # Time to the masks of a first whole output: compile, then the first example's walk.
    entry["compile_plus_first_output_masks_ms"] = entry["compile_ms"] + sum(first[0]["fill_ms"])
    for batch in args.batches:
        walks = []
        for _ in range(args.walk_repeats):
            if batch == 1:
                walks += [walk(adapter, compiled, [r], bitmask, vocab) for r in rows]
            else:
                batch_rows = [rows[i % len(rows)] for i in range(batch)]
                walks.append(walk(adapter, compiled, batch_rows, bitmask, vocab))
        entry[f"batch{batch}"] = walk_stats(walks)
    entry["jump_forward"] = simulate_jump_forward(
        adapter, compiled, case.examples[0], tokenizer, token_bytes
    )
    return entry


def radixlang_compile_ms(case: Case, tokenizer: Any, vocab: int, eos: int, repeats: int) -> float:
    """Cold ``compile_grammar`` (radixlang's path: checks the source, then llguidance); after
    one untimed call, so that importing the checkers (jsonschema, lark) is not counted."""
    from radixlang.constrain import compile_grammar
    from radixlang.constrain import grammar as grammar_module

    compile_grammar(case.kind, case.source, tokenizer, vocab, [eos])
    times = []
    for _ in range(repeats):
        lru = getattr(grammar_module, "_grammars", None)
        if lru is None:  # another layout of the module: no grammar-only cache to empty
            return math.nan
        lru.clear()  # the compiled grammars only; the tokenizer's view stays
        start = time.perf_counter_ns()
        compile_grammar(case.kind, case.source, tokenizer, vocab, [eos])
        times.append(ms_since(start))
    return statistics.median(times)


def coverage(
    adapters: list[Adapter], tokenizer: Any, vocab: int, eos: int
) -> dict[str, dict[str, Any]]:
    """Per probe and engine: compiles, accepts the valid output, rejects the invalid one.

    llguidance goes through radixlang's ``compile_grammar`` (what a request meets)."""
    from radixlang.constrain import ConstraintError, compile_grammar

    def accepts(adapter: Adapter, compiled: Any, text: str) -> bool:
        matcher = adapter.new_matcher(compiled)
        tokens = [*tokenizer.encode(text, add_special_tokens=False), eos]
        return all(adapter.advance(matcher, t) for t in tokens)

    out: dict[str, dict[str, Any]] = {}
    for name, kind, source, valid, invalid in COVERAGE:
        row: dict[str, Any] = {"kind": kind}
        for adapter in adapters:
            try:
                if adapter.name == "llguidance":
                    radix_kind = {"lark": "grammar"}.get(kind, kind)
                    try:
                        compiled = compile_grammar(radix_kind, source, tokenizer, vocab, [eos])
                    except ConstraintError as e:
                        # Does llguidance itself take it (without radixlang's checks and
                        # closed objects)? Then radixlang's wrapper is what refuses it.
                        try:
                            assert isinstance(adapter, LLGuidance)
                            adapter.compile(kind, source, closed=False)
                            raw = True
                        except Exception:
                            raw = False
                        row[adapter.name] = {
                            "compiles": False,
                            "error": f"{type(e).__name__}: {e}"[:240],
                            "llguidance_alone_compiles": raw,
                        }
                        continue
                    compiled = compiled.template
                else:
                    compiled = adapter.compile(kind, source)
            except Unsupported:
                row[adapter.name] = {"compiles": None}
                continue
            except Exception as e:
                row[adapter.name] = {"compiles": False, "error": f"{type(e).__name__}: {e}"[:240]}
                continue
            ok, bad = accepts(adapter, compiled, valid), accepts(adapter, compiled, invalid)
            row[adapter.name] = {
                "compiles": True,
                "accepts_valid": ok,
                "rejects_invalid": not bad,
                "enforced": ok and not bad,
            }
        out[name] = row
    return out


# ---- summary and plot ------------------------------------------------------------------------
def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else math.nan


def summarize(result: dict[str, Any], batches: list[int]) -> dict[str, Any]:
    names = list(result["engines"])
    cases = result["cases"]
    summary: dict[str, Any] = {"coverage": {}, "vs_llguidance": {}}
    for name in names:
        probes = [row[name] for row in result["coverage"].values() if name in row]
        applicable = [p for p in probes if p.get("compiles") is not None]
        summary["coverage"][name] = {
            "probes": len(applicable),
            "compiles": sum(bool(p.get("compiles")) for p in applicable),
            "enforced": sum(bool(p.get("enforced")) for p in applicable),
            "cases_compiled": [c for c, e in cases.items() if "compile_ms" in e.get(name, {})],
            "cases_failed": [c for c, e in cases.items() if "error" in e.get(name, {})],
        }
    metrics = {"compile_ms": lambda e: e["compile_ms"]}
    metrics["fresh_matcher_us"] = lambda e: e["fresh_matcher_us"]
    metrics["compile_plus_first_output_masks_ms"] = lambda e: e[
        "compile_plus_first_output_masks_ms"
    ]
    for b in batches:
        for q in ("p50", "p99"):
            metrics[f"batch{b}_fill_ms_{q}"] = lambda e, b=b, q=q: e[f"batch{b}"][f"fill_ms_{q}"]
            metrics[f"batch{b}_bool_ms_{q}"] = lambda e, b=b, q=q: e[f"batch{b}"][f"bool_ms_{q}"]
    for other in (n for n in names if n != "llguidance"):
        shared = [
            c
            for c, e in cases.items()
            if "compile_ms" in e.get("llguidance", {}) and "compile_ms" in e.get(other, {})
        ]
        if not shared:
            continue
        ratios = {
            metric: geomean([get(cases[c][other]) / get(cases[c]["llguidance"]) for c in shared])
            for metric, get in metrics.items()
        }
        summary["vs_llguidance"][other] = {
            "cases": shared,
            "geomean_time_ratio_other_over_llguidance": ratios,
            "other_faster_on": sorted(m for m, r in ratios.items() if r < 1),
            "llguidance_faster_on": sorted(m for m, r in ratios.items() if r > 1),
        }
    return summary


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases, names = list(result["cases"]), list(result["engines"])
    batches = result["config"]["batches"]
    fig, axes = plt.subplots(2, 2, figsize=(max(12, 0.9 * len(cases) + 4), 8.5))
    width = 0.8 / len(names)

    def bars(ax: Any, get: Callable[[dict[str, Any]], float | None], p99: Any = None) -> None:
        for j, name in enumerate(names):
            xs, ys, tops = [], [], []
            for i, case in enumerate(cases):
                entry = result["cases"][case].get(name, {})
                if "compile_ms" in entry:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(get(entry))
                    tops.append(p99(entry) if p99 else None)
            ax.bar(xs, ys, width, label=name, color=f"C{j}")
            if p99:
                ax.scatter(xs, tops, marker="_", color="k", s=60, zorder=3)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")

    bars(axes[0, 0], lambda e: e["compile_ms"])
    axes[0, 0].set_ylabel("ms (log)")
    axes[0, 0].set_title("(a) cold compile", fontsize=9)
    axes[0, 0].legend(fontsize=8)
    for ax, b in ((axes[0, 1], batches[0]), (axes[1, 0], batches[-1])):
        bars(ax, lambda e, b=b: e[f"batch{b}"]["bool_ms_p50"],
             lambda e, b=b: e[f"batch{b}"]["bool_ms_p99"])  # fmt: skip
        ax.set_ylabel("ms per step (log)")
        ax.set_title(f"mask per step at batch {b}, to bool rows: bar p50, tick p99", fontsize=9)
    axes[0, 1].set_title("(b) " + axes[0, 1].get_title(), fontsize=9)
    axes[1, 0].set_title("(c) " + axes[1, 0].get_title(), fontsize=9)
    ax = axes[1, 1]
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, case in enumerate(cases):
            jf = result["cases"][case].get(name, {}).get("jump_forward", {})
            if "model_steps_cut" in jf:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                ys.append(100 * jf["model_steps_cut"])
        ax.bar(xs, ys, width, label=name, color=f"C{j}")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("% of model steps cut")
    ax.set_title("(d) jump-forward on the first example (regex automaton: none)", fontsize=9)
    cov = result["summary"]["coverage"]
    fig.suptitle(
        "Grammar engines on the SmolLM2 tokenizer; coverage probes enforced: "
        + ", ".join(f"{n} {c['enforced']}/{c['probes']}" for n, c in cov.items()),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--cases", nargs="+", default=None, help="default: all (quick: a few)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 32")
    parser.add_argument("--compile-repeats", type=int, default=None, help="default 5")
    parser.add_argument("--walk-repeats", type=int, default=None, help="default 3")
    parser.add_argument(
        "--threads", type=int, default=min(4, os.cpu_count() or 1), help="batch mask threads"
    )
    parser.add_argument("--no-coverage", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke test: a few cases, batch 4")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batches = args.batches or ([1, 4] if quick else [1, 32])
    args.compile_repeats = args.compile_repeats or (1 if quick else 5)
    args.walk_repeats = args.walk_repeats or (1 if quick else 3)
    cases = all_cases()
    wanted = args.cases or (list(QUICK_CASES) if quick else [c.name for c in cases])
    unknown = set(wanted) - {c.name for c in cases}
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    cases = [c for c in cases if c.name in wanted]

    load_before = os.getloadavg()
    files = load_model_files(args.model)
    tokenizer = files.load_tokenizer()
    vocab = files.config.vocab_size
    eos = int(tokenizer.eos_token_id)
    adapters: list[Adapter] = []
    skipped: dict[str, str] = {}
    for name in args.engines:
        try:
            adapters.append(ENGINES[name](tokenizer, vocab, [eos], args.threads))
        except ImportError as e:  # xgrammar is not a dependency of radixlang
            skipped[name] = f"not installed: {e}"
            print(f"skipping {name}: {e}", flush=True)
    llg = next((a for a in adapters if a.name == "llguidance"), None)
    if llg is not None:
        token_bytes: Callable[[int], bytes] = lambda t: llg.ll.decode_bytes([t])  # noqa: E731
    else:
        token_bytes = lambda t: tokenizer.decode([t]).encode()  # noqa: E731

    result: dict[str, Any] = {
        "benchmark": "bench_grammar_engines",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
        },
        "provenance": provenance(argv),
        "tokenizer": files.name,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engines": {
            a.name: {"version": a.version, "tokenizer_setup_ms": a.setup_ms, "notes": a.notes}
            for a in adapters
        },
        "engines_skipped": skipped,
        "cases": {},
    }
    for a in adapters:
        print(f"{a.name} {a.version}: tokenizer setup {a.setup_ms:.0f} ms", flush=True)
    for case in cases:
        result["cases"][case.name] = {"kind": case.kind}
        for adapter in adapters:
            entry = bench_case(adapter, case, tokenizer, vocab, eos, token_bytes, args)
            result["cases"][case.name][adapter.name] = entry
            if "compile_ms" in entry:
                big = entry[f"batch{args.batches[-1]}"]
                jf = entry["jump_forward"]
                cut = f"{100 * jf['model_steps_cut']:.0f}%" if "model_steps_cut" in jf else "-"
                print(
                    f"  {case.name:16s} {adapter.name:16s} compile {entry['compile_ms']:8.2f} ms"
                    f"  b1 p50 {entry['batch1']['bool_ms_p50']:.3f} p99 "
                    f"{entry['batch1']['bool_ms_p99']:.3f}  b{args.batches[-1]} p50 "
                    f"{big['bool_ms_p50']:.3f} p99 {big['bool_ms_p99']:.3f} ms  jf cut {cut}"
                    + (f"  REJECTED {big['rejected_tokens']}" if big["rejected_tokens"] else ""),
                    flush=True,
                )
            elif "error" in entry:
                print(f"  {case.name:16s} {adapter.name:16s} {entry['error'][:90]}", flush=True)
    result["coverage"] = {} if args.no_coverage else coverage(adapters, tokenizer, vocab, eos)
    result["machine"]["loadavg_after"] = os.getloadavg()
    result["summary"] = summarize(result, args.batches)
    for name, cov in result["summary"]["coverage"].items():
        print(f"coverage {name}: {cov['enforced']}/{cov['probes']} probes enforced, "
              f"{cov['compiles']} compile")  # fmt: skip
    for other, vs in result["summary"]["vs_llguidance"].items():
        ratios = vs["geomean_time_ratio_other_over_llguidance"]
        print(f"{other} / llguidance time (geomean over {len(vs['cases'])} cases): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_grammar_engines.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
