"""The sampling fields' table (radixlang/sampling_fields.py) is the one place a knob is named:
SamplingParams, the program defaults, gen(), the OpenAI body and /generate's schema all follow
it, and a row added to it reaches every one of them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

import radixlang as sgl
from radixlang import sampling_fields
from radixlang.lang.ir import SamplingDefaults
from radixlang.runtime.sampling import SamplingParams, SamplingParamsError
from radixlang.sampling_fields import (
    FIELDS_BY_NAME,
    PROGRAM_FIELDS,
    SAMPLING_FIELDS,
    check_value,
)
from radixlang.server.api_schema import _SAMPLING
from radixlang.server.openai import ChatBody, CompletionBody

# A valid value other than the default, for each kind.
_SAMPLE = {
    "int": 3,
    "float": 0.5,
    "bool": True,
    "seed": 7,
    "stop": ["END"],
    "token_ids": [5],
    "text": "[a-z]+",
    "schema": {"type": "object"},
    "logit_bias": {"3": 1.5},
}


def _valid(field):
    value = _SAMPLE[field.kind]
    if field.kind == "bool":
        return not field.default
    if field.kind in ("int", "float") and not field.allows(value):
        return field.maximum if field.maximum is not None else (field.minimum or 0) + 1
    return value


def test_names_are_unique_and_kinds_known():
    assert len(FIELDS_BY_NAME) == len(SAMPLING_FIELDS)
    assert len({f.gen for f in PROGRAM_FIELDS}) == len(PROGRAM_FIELDS)
    for f in SAMPLING_FIELDS:
        assert check_value(f, f.default) == f.default, f.name  # defaults pass their own checks
        assert f.help


def test_sampling_params_has_one_field_per_row_with_its_default():
    fields = dataclasses.fields(SamplingParams)
    assert [f.name for f in fields] == [f.name for f in SAMPLING_FIELDS]
    params = SamplingParams()
    for f in SAMPLING_FIELDS:
        assert getattr(params, f.name) == f.default, f.name
    assert SamplingParams().stop is not SamplingParams().stop  # list defaults are not shared


@pytest.mark.parametrize("field", [f for f in SAMPLING_FIELDS if f.minimum is not None])
def test_sampling_params_refuse_values_below_a_rows_minimum(field):
    below = field.minimum - (0 if field.exclusive_minimum else 1)
    if field.kind in ("int", "seed"):
        below = int(below)
    with pytest.raises(SamplingParamsError, match=field.name):
        SamplingParams(**{field.name: below})


def test_program_defaults_and_run_keywords_are_the_program_rows():
    assert [f.name for f in dataclasses.fields(SamplingDefaults)] == [
        f.name for f in PROGRAM_FIELDS
    ]
    resolved = SamplingDefaults().resolve({})
    for f in PROGRAM_FIELDS:
        if f.omit_unset:
            assert f.name not in resolved, f.name  # the backend's default applies
        else:
            assert resolved[f.name] == f.default, f.name


@pytest.mark.parametrize("field", PROGRAM_FIELDS, ids=lambda f: f.name)
def test_gen_takes_every_program_row_under_its_gen_name(field):
    value = _valid(field)
    expr = sgl.gen("x", **{field.gen: value})
    assert expr.sampling[field.name] == value


def test_gen_refuses_a_keyword_that_is_no_row():
    with pytest.raises(TypeError, match="temprature"):
        sgl.gen("x", temprature=0.5)


@pytest.mark.parametrize("body", [ChatBody, CompletionBody])
def test_openai_bodies_take_every_openai_row(body):
    extra: dict = (
        {"messages": [{"role": "user", "content": "hi"}]} if body is ChatBody else {"prompt": "hi"}
    )
    for f in SAMPLING_FIELDS:
        if f.openai is None:
            assert f.openai not in body.model_fields
            continue
        value = _valid(f)
        parsed = body(model="m", **extra, **{f.openai: value})
        sampling = parsed.sampling(None, 16)
        if f.name == "beam_width":
            parsed = body(model="m", **extra, beam_width=3, temperature=0.0)
            assert parsed.sampling(None, 16)["beam_width"] == 3
        elif f.name == "logit_bias":
            assert sampling["logit_bias"] == value
        else:
            assert sampling[f.name] == value, f.name


def test_generate_schema_lists_every_row_with_its_bounds():
    for f in SAMPLING_FIELDS:
        schema = _SAMPLING[f.name]
        assert schema["description"] == f.help
        if f.kind == "float" and f.maximum is not None:
            assert schema["maximum"] == f.maximum


def test_a_row_added_to_the_table_reaches_every_layer():
    """The walk-through of a new knob: one row, and SamplingParams, run()'s and gen()'s
    keywords, the OpenAI body and /generate's schema all take it (in a fresh interpreter,
    where the row is added before the modules that derive from the table are imported)."""
    code = textwrap.dedent(
        """
        import importlib.util, sys
        # The table alone (it imports no radixlang module), before anything derives from it.
        spec = importlib.util.spec_from_file_location("radixlang.sampling_fields", TABLE)
        sf = importlib.util.module_from_spec(spec)
        sys.modules["radixlang.sampling_fields"] = sf
        spec.loader.exec_module(sf)
        knob = sf.SamplingField("xtc_probability", "float", 0.0, "exclude top choices",
                                minimum=0, maximum=1, gen="xtc_probability",
                                openai="xtc_probability")
        sf.SAMPLING_FIELDS += (knob,)
        sf.FIELDS_BY_NAME[knob.name] = knob
        sf.PROGRAM_FIELDS += (knob,)

        from radixlang.runtime.sampling import SamplingParams, SamplingParamsError
        assert SamplingParams(xtc_probability=0.25).xtc_probability == 0.25
        assert SamplingParams.from_dict({"xtc_probability": 1}).xtc_probability == 1.0
        try:
            SamplingParams(xtc_probability=2)
            raise SystemExit("out of bounds accepted")
        except SamplingParamsError as e:
            assert "xtc_probability must be in [0, 1]" in str(e), e

        import radixlang as sgl
        from radixlang.lang.run_options import split_run_kwargs
        assert sgl.gen("x", xtc_probability=0.5).sampling["xtc_probability"] == 0.5
        defaults, rest = split_run_kwargs({"xtc_probability": 0.1, "topic": "t"})
        assert rest == {"topic": "t"}
        assert defaults.resolve({})["xtc_probability"] == 0.1
        assert defaults.resolve({"xtc_probability": 0.3})["xtc_probability"] == 0.3
        assert "xtc_probability: exclude top choices" in sgl.gen.__doc__

        from pydantic import ValidationError
        from radixlang.server.openai import ChatBody
        body = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}],
                        xtc_probability=0.5)
        assert body.sampling(None, 16)["xtc_probability"] == 0.5
        try:
            ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], xtc_probability=3.0)
            raise SystemExit("out of bounds body accepted")
        except ValidationError:
            pass
        from radixlang.server.api_schema import _SAMPLING
        assert _SAMPLING["xtc_probability"]["maximum"] == 1
        print("ok")
        """
    ).replace("TABLE", repr(sampling_fields.__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
