"""Constrained decoding: per-token masks that keep generated text inside a language.

The bottom layer, beside the kernels: it imports torch, llguidance, numpy, lark,
jsonschema and the standard library only, never the runtime, the language or the server
(pyproject's import-linter contracts).
The engine sees a constraint through ``radixlang.runtime.constraint``'s ``TokenConstraint``
protocol, which :class:`GrammarConstraint` (llguidance: regex, JSON schema, Lark and EBNF
grammars) implements. ``sources`` checks and converts a constraint's source without torch or
llguidance, for the compiler and for the language layer alike. (The earlier pure-Python regex
automaton now lives in ``benchmarks/regex_automaton.py``, a peer in the grammar-engine
benchmark.)

The public names load on first use, so importing one light module of the package (``sources``,
``dtypes``, ``errors``) does not load torch and llguidance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlang.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from radixlang.constrain.dtypes import DTYPE_REGEXES, dtype_regex
    from radixlang.constrain.errors import ConstraintError
    from radixlang.constrain.grammar import (
        ANY_JSON_OBJECT,
        KINDS,
        CompiledGrammar,
        GrammarConstraint,
        clear_grammar_cache,
        compile_grammar,
    )
    from radixlang.constrain.sources import json_schema_text
    from radixlang.constrain.vocabulary import (
        TokenVocabulary,
        clear_vocabulary_cache,
        token_vocabulary,
    )

_EXPORTS = {
    "DTYPE_REGEXES": "radixlang.constrain.dtypes",
    "dtype_regex": "radixlang.constrain.dtypes",
    "ConstraintError": "radixlang.constrain.errors",
    "ANY_JSON_OBJECT": "radixlang.constrain.grammar",
    "KINDS": "radixlang.constrain.grammar",
    "CompiledGrammar": "radixlang.constrain.grammar",
    "GrammarConstraint": "radixlang.constrain.grammar",
    "clear_grammar_cache": "radixlang.constrain.grammar",
    "compile_grammar": "radixlang.constrain.grammar",
    "json_schema_text": "radixlang.constrain.sources",
    "TokenVocabulary": "radixlang.constrain.vocabulary",
    "clear_vocabulary_cache": "radixlang.constrain.vocabulary",
    "token_vocabulary": "radixlang.constrain.vocabulary",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "ANY_JSON_OBJECT",
    "DTYPE_REGEXES",
    "KINDS",
    "CompiledGrammar",
    "ConstraintError",
    "GrammarConstraint",
    "TokenVocabulary",
    "clear_grammar_cache",
    "clear_vocabulary_cache",
    "compile_grammar",
    "dtype_regex",
    "json_schema_text",
    "token_vocabulary",
]
