"""What a decode step costs on this device and model, learnt from the steps the engine runs.

A step's seconds are modelled as ``c0 + c1 * sequences + c2 * tokens``: ``c2`` is what one more
verified token costs, which on a CPU (or a GPU at a small batch) is a small share of the step,
and grows with the batch. The fit is a least-squares one over recent decode steps, older steps
weighing less, pulled towards a prior for the device until the steps say otherwise.

A pinned cost (``learn=False``; the engine's ``speculative_step_cost_ms``) keeps its prior:
which drafts are taken then depends on the requests alone, not on how fast or how loaded the
machine is (reproducible draft counts: benchmarks that compare runs, and tests).
"""

from __future__ import annotations

import numpy as np

# Seconds (c0, c1, c2): SmolLM2-135M in bfloat16 on a 2-core Xeon with AMX (steps of 1..32
# sequences with 1..12 tokens each, drafts verified as extends, 2026-12-04), and a guess for a
# GPU's small-batch regime.
CPU_PRIOR = (0.019, 0.001, 0.0004)
GPU_PRIOR = (0.005, 0.00002, 0.00001)
# The prior counts as this many steps at these sizes (sequences, tokens): a few dozen real
# steps outweigh it.
PRIOR_STEPS = 8.0
PRIOR_SHAPE = (4.0, 16.0)
FORGET = 0.995  # each step's weight decays by this much per later step


class StepCost:
    """Online fit of a decode step's seconds against its sequences and tokens."""

    def __init__(self, prior: tuple[float, float, float] = CPU_PRIOR, learn: bool = True) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.learn = learn
        seqs, tokens = PRIOR_SHAPE
        # Ridge towards the prior, scaled as PRIOR_STEPS steps of the prior's shape would be.
        self._penalty = PRIOR_STEPS * np.diag([1.0, seqs * seqs, tokens * tokens])
        self._gram = np.zeros((3, 3))
        self._moment = np.zeros(3)
        self.coef = self.prior.copy()
        self.observed = 0

    def observe(self, seqs: int, tokens: int, seconds: float) -> None:
        if not self.learn:
            return
        x = np.array([1.0, seqs, tokens])
        self._gram = FORGET * self._gram + np.outer(x, x)
        self._moment = FORGET * self._moment + x * seconds
        self.observed += 1
        a = self._gram + self._penalty
        b = self._moment + self._penalty @ self.prior
        coef = np.linalg.solve(a, b)
        # A cost can be small but never free or negative (noise can make the fit say so).
        floor = self.prior * 0.05
        self.coef = np.maximum(coef, floor)

    def seconds(self, seqs: int, tokens: int) -> float:
        c0, c1, c2 = self.coef
        return float(c0 + c1 * seqs + c2 * tokens)

    @property
    def per_token(self) -> float:
        """Seconds one more token costs in a step."""
        return float(self.coef[2])
