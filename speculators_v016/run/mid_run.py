"""A run's rate once its process is warm: tokens/s between two marks inside the run.

A whole run's rate includes its first steps, whose tensors land in memory the process touches for the first
time (on the 2-core VM of issue 53, fresh pages came at 0.19 GB/s against 11.5 GB/s for pages it had used
before: a wide CPU run grew its heap by about 2 GB in its first 20 s), and its last, when the pipeline drains.
A long run goes at neither. The marks follow the forward's progress (the tokens of the steps waited for), read
as each sample is handed over: samples come in bursts (a kept generator's about four steps after their step, the
last sixteen of a 64-prompt pass at once), so marks on the samples' own tokens would time a burst.
"""

from __future__ import annotations

import time

#: The marks, as shares of the run's tokens.
MARKS = (0.5, 0.9)


class MidRun:
    """Note the tokens computed so far (:meth:`passed`), then the rate between the marks (:meth:`rate`)."""

    def __init__(self, total_tokens: int | None, started: float, clock=time.monotonic) -> None:
        self.total, self.started, self.clock = total_tokens, started, clock
        self.at: list[tuple[int, float]] = []  # (tokens, s since the start) at each mark passed

    def passed(self, tokens: int) -> None:
        """``tokens`` computed so far (read after each sample handed over)."""
        while self.total and len(self.at) < len(MARKS) and tokens >= MARKS[len(self.at)] * self.total:
            self.at.append((tokens, self.clock() - self.started))

    def rate(self) -> float | None:
        """Tokens/s between the marks; None where the run's tokens were not known before it (``--regenerate``)
        or both were passed at one reading."""
        if len(self.at) < len(MARKS):
            return None
        (t0, s0), (t1, s1) = self.at
        return (t1 - t0) / (s1 - s0) if t1 > t0 and s1 > s0 else None
