"""The regexes behind gen(dtype=...): what each accepts, and the types refused."""

import json
import re

import pytest

from radixlang.constrain import ConstraintError, dtype_regex


def test_dtype_regex_matches_the_right_samples():
    assert re.fullmatch(dtype_regex(int), "-42") and not re.fullmatch(dtype_regex(int), "4.2")
    assert re.fullmatch(dtype_regex(float), "4.2") and re.fullmatch(dtype_regex(float), "42")
    assert re.fullmatch(dtype_regex(bool), "True") and not re.fullmatch(dtype_regex(bool), "true")
    assert re.fullmatch(dtype_regex(str), '"a b"') and not re.fullmatch(dtype_regex(str), "a")


@pytest.mark.parametrize("bad", [list, "complex", 3, None])
def test_dtype_regex_rejects_other_types(bad):
    with pytest.raises(ConstraintError, match="unsupported dtype"):
        dtype_regex(bad)


@pytest.mark.parametrize(
    "text",
    [
        '""',
        '"Paris"',
        '"Europe/Paris"',
        r'"a \"quoted\" word"',
        r'"tab\there"',
        r'"\u00e9t\u00e9"',
        '"caf\u00e9 \u2014 ok"',
    ],
)
def test_a_str_gen_matches_exactly_the_json_strings(text):
    assert re.fullmatch(dtype_regex(str), text)
    assert isinstance(json.loads(text), str)


@pytest.mark.parametrize(
    "text",
    ['"a\tb"', '"line\nbreak"', '"nul\x00"', r'"bad \q escape"', r'"\u12"', '"unclosed', '"a"b"'],
)
def test_a_str_gen_refuses_what_json_refuses(text):
    """A raw control character or a bad escape inside would break the JSON the string goes in."""
    assert not re.fullmatch(dtype_regex(str), text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
