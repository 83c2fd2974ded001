"""The regexes behind gen(dtype=...): what each accepts, and the types refused."""

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
