"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM: at the next safe point, with a checkpoint.

`diffrl train` and `diffrl sft` run inside `stop_signals(command)` (diffrl/cli.py):

- In the training loop (`TrainingLoop.fit`, decorated with `stops_at_safe_points`), the first
  signal is a request: a line says so at once, the step in progress finishes, its metrics record is
  written and a checkpoint saved, then the loop ends as the watchdog's stops do
  (`TrainingLoop.stopped`, `stop_message`): the run exports and reports what it has, and the
  command prints one line with the command that resumes it and exits 128 + the signal (130 for
  SIGINT, 143 for SIGTERM). A second signal stops at once.
- Anywhere else (loading the model, the start-up check, the export and report at the end), and for
  that second signal, the run stops at once: `Interrupted`, a `KeyboardInterrupt`, unwinds what the
  run started (workers shut down, Ray stopped, a half-made run folder removed) and the command
  prints one line instead of a traceback, with the same exit status.

Without `stop_signals` (a library caller, the tests that call `train()`) nothing changes: Ctrl-C
raises `KeyboardInterrupt` wherever it lands. The handlers live in the process's main thread (where
Python runs signal handlers); `diffrl.workers.ensure_ray` keeps them across `ray.init`, which
would replace SIGTERM's with its own (a `sys.exit` that ends in SIGABRT). Ray's workers run in
process groups of their own, so a terminal's Ctrl-C does not reach them.

Imports nothing heavy: the CLI enters it before torch, diffusers or Ray load.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "STOP_SIGNALS",
    "Interrupted",
    "StopSignals",
    "resume_command",
    "stop_message",
    "stop_requested",
    "stop_signals",
    "stops_at_safe_points",
]

#: The signals that stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A copy of the same signal this soon after the first is the same request: a wrapper in the
# terminal's process group (`timeout`, a launcher) forwards the Ctrl-C the terminal also sent us.
_REPEAT_S = 1.0


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the run at once (outside the training loop, or a second signal)."""

    def __init__(self, signum: int, hint: str = "") -> None:
        super().__init__(signum)
        self.signum = signum
        self.hint = hint  # how to go on: the resume command, once the loop knows the run

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        line = f"stopped at once by {signal.Signals(self.signum).name}"
        return f"{line}; {self.hint}" if self.hint else line


class StopSignals:
    """What `stop_signals` installed: the command (for the resume line) and the signal received."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.received: int | None = None  # the first stop signal, once one came
        self.requested: int | None = None  # a signal that asked the loop to stop at a safe point
        self.requested_at = 0.0
        self.deferring = False  # inside the training loop: the first signal waits for a safe point

    def exit_status(self, default: int) -> int:
        """128 + the signal that stopped the run, or `default` when none did."""
        return default if self.received is None else 128 + self.received

    def handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.requested is not None and signum == self.requested and now - self.requested_at < _REPEAT_S:
            return  # the same Ctrl-C, forwarded
        if self.received is None:
            self.received = signum
        if self.deferring and self.requested is None:
            self.requested, self.requested_at = signum, now
            name = signal.Signals(signum).name
            # os.write, not print: a handler that prints while the interrupted code prints raises
            # "reentrant call" in the buffered stream
            os.write(
                2,
                f"\n{name} received: the run stops after the current step, with its metrics and a "
                f"checkpoint (Ctrl-C or another SIGTERM stops it at once)\n".encode(),
            )
            return
        raise Interrupted(signum)


_active: StopSignals | None = None  # the one `stop_signals` of this process, while it lasts


@contextmanager
def stop_signals(command: Sequence[str]) -> Iterator[StopSignals]:
    """Handle SIGINT and SIGTERM as the module docstring says while the block runs (`command` is
    how the run was started: the resume line repeats it); the previous handlers after. From the
    main thread only (elsewhere signals cannot be handled): from another thread nothing changes."""
    global _active
    signals = StopSignals(command)
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, signals.handle)
    _active = signals
    try:
        yield signals
    finally:
        _active = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


F = TypeVar("F", bound=Callable[..., Any])


def stops_at_safe_points(fit: F) -> F:
    """Decorate `TrainingLoop.fit`: while it runs, a first stop signal asks the loop to stop at its
    next safe point (`stop_requested`) instead of stopping at once; a stop at once that ends it
    says how to resume (the loop's `run_dir` names the run)."""

    @functools.wraps(fit)
    def deferring(loop: Any, *args: Any, **kwargs: Any) -> Any:
        signals = _active
        if signals is None:
            return fit(loop, *args, **kwargs)
        signals.deferring = True
        try:
            return fit(loop, *args, **kwargs)
        except Interrupted as stop:
            stop.hint = _resume_hint(signals.command, loop.run_dir)
            raise
        finally:
            signals.deferring = False

    return deferring  # type: ignore[return-value]


def stop_requested() -> int | None:
    """The signal that asked the training loop to stop at its next safe point, or None."""
    return None if _active is None else _active.requested


def stop_message(checkpoint: Path, run_dir: Path) -> str | None:
    """`TrainingLoop.stopped` for a stop a signal requested (None when none did): the signal, the
    checkpoint the loop just saved, and the command that resumes the run."""
    if _active is None or _active.requested is None:
        return None
    name = signal.Signals(_active.requested).name
    return (
        f"{name} received: the run stopped with its checkpoint {checkpoint}; resume it with: "
        f"{resume_command(_active.command, run_dir)}"
    )


def _resume_hint(command: Sequence[str], run_dir: Path) -> str:
    """How to go on after a stop at once: resume the newest checkpoint, or, with none saved, start
    anew (the folder's records refuse a start from step 0 under its name)."""
    from diffrl.train.checkpoint_files import complete_checkpoints

    saved = complete_checkpoints(run_dir / "checkpoints")
    if not saved:
        return (
            f"{run_dir} has no checkpoint to resume from: start the run again under another trainer.run_name"
        )
    return f"its newest checkpoint is {saved[-1][1]}; resume it with: {resume_command(command, run_dir)}"


def resume_command(command: Sequence[str], run_dir: Path) -> str:
    """`command` (`diffrl train [PRESET] [key=value ...]`) continuing the run in `run_dir`: its
    own `trainer.run_name` and `trainer.resume` replaced by the run's name and `auto`."""
    replaced = ("trainer.run_name=", "trainer.resume=")
    kept = [item for item in command if not item.startswith(replaced)]
    return shlex.join([*kept, f"trainer.run_name={run_dir.name}", "trainer.resume=auto"])
