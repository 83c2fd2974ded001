"""Constrained decoding: per-token masks that keep generated text inside a language.

The bottom layer, beside the kernels: it imports torch, llguidance, interegular and the
standard library only, never the runtime, the language or the server (pyproject's
import-linter contracts).
The engine sees a constraint through ``radixlang.runtime.constraint``'s ``TokenConstraint``
protocol, which :class:`GrammarConstraint` (llguidance: regex, JSON schema, Lark and EBNF
grammars) implements. ``regex_guide`` is the earlier pure-Python regex automaton, kept as a
peer for ``benchmarks/bench_grammar_engines.py``; the engine no longer uses it.
"""

from radixlang.constrain.dtypes import DTYPE_REGEXES, dtype_regex
from radixlang.constrain.errors import ConstraintError
from radixlang.constrain.grammar import (
    ANY_JSON_OBJECT,
    KINDS,
    CompiledGrammar,
    GrammarConstraint,
    clear_grammar_cache,
    compile_grammar,
    json_schema_text,
)
from radixlang.constrain.regex_guide import (
    RegexConstraint,
    RegexGuide,
    StateMask,
    clear_guide_cache,
    compile_regex,
    get_regex_guide,
)
from radixlang.constrain.vocabulary import TokenVocabulary, clear_vocabulary_cache, token_vocabulary

__all__ = [
    "ANY_JSON_OBJECT",
    "DTYPE_REGEXES",
    "KINDS",
    "CompiledGrammar",
    "ConstraintError",
    "GrammarConstraint",
    "RegexConstraint",
    "RegexGuide",
    "StateMask",
    "TokenVocabulary",
    "clear_grammar_cache",
    "clear_guide_cache",
    "clear_vocabulary_cache",
    "compile_grammar",
    "compile_regex",
    "dtype_regex",
    "get_regex_guide",
    "json_schema_text",
    "token_vocabulary",
]
