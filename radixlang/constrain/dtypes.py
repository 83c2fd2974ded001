"""The regex a typed generation (``gen(dtype=int)`` and friends) is constrained to."""

from __future__ import annotations

from radixlang.constrain.errors import ConstraintError

# Each is a plain regex (no anchors, no lookarounds) that every regex engine and Python's ``re``
# agrees with, so ``re.fullmatch(dtype_regex(t), text)`` holds for every constrained output.
DTYPE_REGEXES: dict[str, str] = {
    "int": r"[-+]?[0-9]+",
    "float": r"[-+]?[0-9]*\.?[0-9]+",
    "bool": r"(True|False)",
    # A JSON string: no raw control character (a tab or newline inside breaks json.loads of
    # the object it is written into, as in SGLang's test_decode_json), only JSON's escapes.
    "str": r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
}


def dtype_regex(dtype: type | str) -> str:
    """The regex for ``int``, ``float``, ``bool`` or ``str`` (the type or its name)."""
    name = dtype.__name__ if isinstance(dtype, type) and dtype in (int, float, bool, str) else dtype
    if isinstance(name, str) and name in DTYPE_REGEXES:
        return DTYPE_REGEXES[name]
    raise ConstraintError(
        f"unsupported dtype {dtype!r}: expected one of int, float, bool, str (or their names)"
    )
