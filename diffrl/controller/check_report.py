"""`diffrl check`'s result: one row per check (measured value, tolerance, verdict) and the table.

A row passes, fails (with what to change), or is skipped (the check does not apply to this
config, with the reason). The exit status of `diffrl check` is 0 when no row failed, 1 otherwise
(a bad config never gets this far: it is exit 2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


@dataclass(frozen=True)
class CheckRow:
    """One check: what it compared, the value it measured, the tolerance, and the verdict.
    `note` says, for a failure, what is wrong and the setting to change; for a skip, why."""

    check: str
    measured: str
    tolerance: str
    verdict: str
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL


def row(check: str, measured: str, tolerance: str, ok: bool, fix: str = "") -> CheckRow:
    """A pass or a fail; `fix` (what to change) is kept for a failure only."""
    return CheckRow(check, measured, tolerance, PASS if ok else FAIL, "" if ok else fix)


def skipped(check: str, why: str) -> CheckRow:
    return CheckRow(check, "-", "-", SKIP, why)


@dataclass
class CheckReport:
    """Every row of a check, in the order the checks ran, and the seconds it took."""

    rows: list[CheckRow]
    seconds: float = 0.0

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.failed]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def row(self, check: str) -> CheckRow:
        """The row named `check` (tests and tools)."""
        for r in self.rows:
            if r.check == check:
                return r
        raise KeyError(f"no check named {check!r}; checks: {[r.check for r in self.rows]}")

    def table(self) -> str:
        """The rows as a plain-text table, failures' notes below it."""
        header = ("check", "measured", "tolerance", "verdict")
        cells = [header] + [(r.check, r.measured, r.tolerance, r.verdict) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(4)]
        lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        notes = [r for r in self.rows if r.note]
        if notes:
            lines.append("")
            lines += [f"{r.verdict} {r.check}: {r.note}" for r in notes]
        failed = self.failed
        lines.append("")
        lines.append(
            f"{len(self.rows) - len(failed)} of {len(self.rows)} checks passed or skipped in "
            f"{self.seconds:.1f} s" + (f"; FAILED: {', '.join(r.check for r in failed)}" if failed else "")
        )
        return "\n".join(lines) + "\n"


def fmt(value: float) -> str:
    """A measured number, short."""
    return f"{value:.3g}"


def fmt_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(fmt(v) for v in values) + "]"
