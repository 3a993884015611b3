"""Progress in plain lines, for `diffrl sample` where its output is no terminal (a log file, a
pipe, a job's captured output): rich's live bar draws nothing there, so a long sampling run (a
large image on the CPU takes minutes a step) printed nothing until it ended or was killed.

`LineProgress` takes the calls the sampler makes on rich's `Progress` (`TrajectorySampler(...,
progress=...)`): a line when sampling starts, then at most one every `every_s` seconds as denoising
steps finish, and one at the end; each flushed at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def duration(seconds: float) -> str:
    """e.g. "42 s", "3 min 5 s", "1 h 2 min"."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class LineProgress:
    """The sampler's progress as lines: "sampling 8 samples x 28 steps: 25% after 1 min 2 s, about
    3 min 6 s left". `samples` and `steps` name what the sampler's total (samples x steps) counts."""

    def __init__(
        self,
        samples: int,
        steps: int,
        *,
        every_s: float = 10.0,
        file: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what = f"sampling {samples} sample{'s' if samples != 1 else ''} x {steps} steps"
        self.every_s = every_s
        self.file = file
        self.clock = clock
        self.total = self.done = 0
        self.start = self.last = 0.0

    def __call__(self) -> LineProgress:  # the sampler's factory: a fresh count per sampling call
        return self

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def print(self, text: str) -> None:
        print(text, file=self.file or sys.stdout, flush=True)

    def add_task(self, description: str, total: int) -> int:
        self.total, self.done = int(total), 0
        self.start = self.last = self.clock()
        self.print(f"{self.what}: started")
        return 0

    def advance(self, task: int, amount: float = 1) -> None:
        self.done += int(amount)
        now = self.clock()
        if self.done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.start
        share = self.done / self.total if self.total else 1.0
        left = f", about {duration(elapsed * (1 - share) / share)} left" if 0 < share < 1 else ""
        self.print(f"{self.what}: {share:.0%} after {duration(elapsed)}{left}")
