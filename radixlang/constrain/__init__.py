"""Constrained decoding: per-token masks that keep generated text inside a language.

The bottom layer, beside the kernels: it imports torch, interegular and the standard library
only, never the runtime, the language or the server (pyproject's import-linter contracts).
The engine sees a constraint through ``radixlang.runtime.constraint``'s ``TokenConstraint``
protocol, which :class:`RegexConstraint` implements.
"""

from radixlang.constrain.dtypes import DTYPE_REGEXES, dtype_regex
from radixlang.constrain.errors import ConstraintError
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
    "DTYPE_REGEXES",
    "ConstraintError",
    "RegexConstraint",
    "RegexGuide",
    "StateMask",
    "TokenVocabulary",
    "clear_guide_cache",
    "clear_vocabulary_cache",
    "compile_regex",
    "dtype_regex",
    "get_regex_guide",
    "token_vocabulary",
]
