"""The thread governor: fewer threads while other processes hold cores, all of them after."""

from pathlib import Path

import pytest
import torch

from radixlang.runtime import cpu_threads
from radixlang.runtime.cpu_threads import (
    ThreadGovernor,
    machine_busy_ticks,
    process_busy_ticks,
    threads_for,
)


def stat_line(busy: int, idle: int) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def self_stat(utime: int, stime: int = 0) -> str:
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
    return "1234 (python (x) y) " + " ".join(fields)


def test_parsing_proc_files():
    assert machine_busy_ticks(stat_line(70, 30)) == (70, 100)
    assert process_busy_ticks(self_stat(12, 5)) == 17  # a command name with ')' and spaces


@pytest.mark.parametrize(
    ("others", "want"), [(0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (2.0, 1), (1.9, 1)]
)
def test_threads_for_the_cores_left(others, want):
    assert threads_for(others, cores=2, max_threads=2) == want


def test_threads_never_exceed_the_configured_count():
    assert threads_for(0.0, cores=8, max_threads=3) == 3
    assert threads_for(6.0, cores=8, max_threads=3) == 2


class FakeMachine:
    """/proc as a busy neighbour and this process would leave it, with a clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = self.total = self.own = 0

    def advance(self, seconds: float, own_cores: float, other_cores: float, cores: int = 2):
        ticks = int(seconds * 100)
        self.now += seconds
        self.total += ticks * cores
        self.own += int(ticks * own_cores)
        self.busy += int(ticks * (own_cores + other_cores))

    def read(self, path: Path) -> str:
        if path == cpu_threads.PROC_STAT:
            return stat_line(self.busy, self.total - self.busy)
        return self_stat(self.own)


def test_governor_drops_a_thread_beside_a_burner_and_restores_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    fake = FakeMachine()
    gov = ThreadGovernor(
        max_threads=2, interval_s=0.5, cores=2, read=fake.read, clock=lambda: fake.now
    )
    fake.advance(0.2, own_cores=2, other_cores=0)
    assert gov.update() == 2 and calls == []  # within the interval: not even sampled
    fake.advance(0.4, own_cores=2, other_cores=0)
    assert gov.update() == 2 and calls == []
    fake.advance(1.0, own_cores=1, other_cores=1)  # a burner takes a core
    assert gov.update() == 1 and calls == [1]
    assert gov.other_cores_busy == pytest.approx(1.0)
    fake.advance(1.0, own_cores=1, other_cores=1)
    assert gov.update() == 1 and calls == [1]  # steady: no flapping
    fake.advance(1.0, own_cores=1, other_cores=0)  # the burner ends
    assert gov.update() == 2 and calls == [1, 2]
    assert gov.changes == 2


def test_governor_without_proc_keeps_the_count(monkeypatch):
    def missing(path: Path) -> str:
        raise OSError("no /proc here")

    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail("must not change"))
    gov = ThreadGovernor(max_threads=2, read=missing)
    assert gov.enabled is False
    assert gov.update() == 2
