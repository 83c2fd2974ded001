"""Beam search through ``POST /generate``: sampling_params.beam_width and its meta info."""

from __future__ import annotations

import json

import pytest
from server_checks import assert_no_leak

BEAMS = {"beam_width": 3, "temperature": 0, "max_new_tokens": 8, "length_penalty": 0.8}


@pytest.mark.compares_outputs
def test_generate_with_beams_matches_the_engine(client, engine):
    response = client.post("/generate", json={"text": "Once upon a time", "sampling_params": BEAMS})
    assert response.status_code == 200, response.text
    out = response.json()
    alone = engine.generate("Once upon a time", BEAMS)
    assert out["output_ids"] == alone.output_ids and out["text"] == alone.text
    beams = out["meta_info"]["beams"]
    assert [b["output_ids"] for b in beams] == [b.output_ids for b in alone.beams]
    assert beams[0]["score"] == alone.beams[0].score


@pytest.mark.compares_outputs
def test_streamed_beams_end_with_the_best(client, engine):
    body = {"text": "Once upon a time", "sampling_params": BEAMS, "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["output_ids"] == engine.generate("Once upon a time", BEAMS).output_ids


def test_unsupported_beam_search_is_a_400(client, engine):
    for params, word in (
        ({"beam_width": 2, "max_new_tokens": 4}, "temperature"),
        ({"beam_width": 2, "temperature": 0, "regex": "a+"}, "regex"),
        ({"beam_width": 0}, "beam_width"),
    ):
        response = client.post("/generate", json={"text": "Hi", "sampling_params": params})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == f"sampling_params.{word}"
    assert_no_leak(client)


def test_extreme_length_penalties_answer_finite_scores(client, engine):
    # n ** 1e308 overflowed (the engine step failed: a 500) and n ** -100 is 0 in float32
    # (scores of -inf, which JSON cannot carry: a 500 too).
    for penalty in (1e308, -1e308, 100.0, -100.0):
        params = {**BEAMS, "max_new_tokens": 4, "length_penalty": penalty}
        response = client.post("/generate", json={"text": "Hi there", "sampling_params": params})
        assert response.status_code == 200, response.text
        scores = [b["score"] for b in response.json()["meta_info"]["beams"]]
        assert scores and all(abs(s) < float("inf") for s in scores)
    assert_no_leak(client)
    engine.check_integrity()
