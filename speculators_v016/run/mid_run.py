"""A run's rate once its process is warm: the forward's tokens/s between two marks inside the run.

A whole run's rate includes its first steps, whose tensors land in memory the process touches for the first
time (on the 2-core VM of issue 53, fresh pages came at 0.19 GB/s against 11.5 GB/s for pages it had used
before: a wide CPU run grew its heap by about 2 GB in its first 20 s), and its last, when the pipeline drains.
A long run goes at neither. The marks are the samples handed over that pass half and nine tenths of the run's
samples; what is timed between them is the forward's progress (the tokens of the steps waited for, read at
each mark), since samples come in bursts (a kept generator's about four steps after their step, the last
sixteen of a 64-prompt pass at once) and their own tokens would time a burst.
"""

from __future__ import annotations

import time

#: The marks, as shares of the run's samples.
MARKS = (0.5, 0.9)
#: Fewer steps than this between the marks: no rate (a step's granularity would make most of it).
MIN_STEPS = 8


class MidRun:
    """Note each sample handed over (:meth:`passed`), then the forward's rate between the marks (:meth:`rate`)."""

    def __init__(self, total_samples: int | None, started: float, clock=time.monotonic) -> None:
        self.total, self.started, self.clock = total_samples, started, clock
        self.at: list[tuple[int, int, float]] = []  # (tokens computed, steps, s since the start) at each mark

    def passed(self, handed: int, computed: int, steps: int) -> None:
        """``handed`` samples so far, the forward having computed ``computed`` tokens in ``steps`` steps."""
        while self.total and len(self.at) < len(MARKS) and handed >= MARKS[len(self.at)] * self.total:
            self.at.append((computed, steps, self.clock() - self.started))

    def rate(self) -> float | None:
        """Tokens/s computed between the marks; None where the run's samples were not known before it
        (``--regenerate``), or fewer than :data:`MIN_STEPS` steps lie between them."""
        if len(self.at) < len(MARKS):
            return None
        (t0, n0, s0), (t1, n1, s1) = self.at
        return (t1 - t0) / (s1 - s0) if n1 - n0 >= MIN_STEPS and t1 > t0 and s1 > s0 else None
