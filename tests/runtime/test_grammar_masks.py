"""MaskFiller: prefetched masks are used only for exactly the rows they were filled for, the
worker never runs beside the caller's use of the constraints, and faults reach the caller."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
import torch

from radixlang.runtime.grammar_masks import MaskFiller


class Rows:
    """A constraint class with a batched fill that records who called it and when."""

    calls: ClassVar[list[tuple[str, tuple[int, ...]]]] = []
    delay = 0.0
    fail = False
    gate: threading.Event | None = None  # a fill waits for it where set

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed

    @staticmethod
    def batch_allowed_masks(constraints, width):
        time.sleep(Rows.delay)
        if Rows.gate is not None:
            assert Rows.gate.wait(60), "the test never opened the gate"
        Rows.calls.append((threading.current_thread().name, tuple(c.allowed for c in constraints)))
        if Rows.fail:
            raise RuntimeError("fill failed")
        out = torch.zeros((len(constraints), width), dtype=torch.bool)
        for i, c in enumerate(constraints):
            out[i, c.allowed] = True
        return out


@pytest.fixture(autouse=True)
def reset():
    Rows.calls, Rows.delay, Rows.fail, Rows.gate = [], 0.0, False, None
    yield
    if Rows.gate is not None:  # a failed test leaves no fill waiting on it
        Rows.gate.set()


def test_prefetched_masks_are_filled_on_the_worker_and_taken():
    filler = MaskFiller(overlap=True)
    rows = [Rows(1), Rows(3)]
    filler.prefetch(Rows, rows, 5)
    filler.wait()
    masks = filler.fill(Rows, rows, 5)
    filler.settle()
    assert masks.nonzero().tolist() == [[0, 1], [1, 3]]
    assert len(Rows.calls) == 1 and Rows.calls[0][0].startswith("radixlang-masks")
    stats = filler.percentiles_ms()
    assert stats["grammar_mask_steps"] == 1 and len(filler.wait_seconds) == 1
    filler.close()


def test_other_rows_than_prefetched_are_filled_now():
    filler = MaskFiller(overlap=True)
    a, b = Rows(0), Rows(2)
    filler.prefetch(Rows, [a, b], 4)
    masks = filler.fill(Rows, [b], 4)  # a left the batch: the prefetched fill is not used
    assert masks.nonzero().tolist() == [[0, 2]]
    assert [names for _, names in Rows.calls] == [(0, 2), (2,)]
    assert Rows.calls[1][0] == threading.current_thread().name
    masks = filler.fill(Rows, [a, b], 8)  # nothing pending now: computed inline, any width
    assert masks.shape == (2, 8)
    filler.close()


def test_settle_waits_for_a_fill_nobody_took():
    """The fill is held on a gate (not a time): settle must still be waiting while it is
    closed, and return once the fill is done."""
    filler = MaskFiller(overlap=True)
    Rows.gate = threading.Event()
    filler.prefetch(Rows, [Rows(1)], 4)
    settling = threading.Thread(target=filler.settle)
    settling.start()
    settling.join(0.3)
    assert settling.is_alive() and Rows.calls == []  # waits for the fill in progress
    Rows.gate.set()
    settling.join(60)
    assert not settling.is_alive() and len(Rows.calls) == 1
    filler.close()


def test_a_failed_fill_raises_to_the_caller():
    filler = MaskFiller(overlap=True)
    Rows.fail = True
    filler.prefetch(Rows, [Rows(1)], 4)
    filler.wait()
    with pytest.raises(RuntimeError, match="fill failed"):
        filler.fill(Rows, [Rows(1)], 4)  # other rows: the failed prefetch is dropped quietly
    rows = [Rows(2)]
    filler.prefetch(Rows, rows, 4)
    with pytest.raises(RuntimeError, match="fill failed"):
        filler.fill(Rows, rows, 4)
    filler.close()


def test_without_overlap_nothing_runs_on_a_worker():
    filler = MaskFiller(overlap=False)
    rows = [Rows(1)]
    filler.prefetch(Rows, rows, 4)
    filler.wait()
    assert Rows.calls == []
    assert filler.fill(Rows, rows, 4).nonzero().tolist() == [[0, 1]]
    filler.settle()
    assert Rows.calls[0][0] == threading.current_thread().name
    assert len(filler.wait_seconds) == 1 and filler.wait_seconds[0] > 0
