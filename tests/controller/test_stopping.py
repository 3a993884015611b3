"""Stop signals (diffrl/controller/stopping.py), with real signals sent to this process: outside the
training loop the first one stops at once; inside it the first asks for a stop at the next safe
point, a copy of it within a second is the same request, and a second signal stops at once naming
the newest checkpoint and the resume command. `diffrl train` under SIGTERM end to end:
tests/controller/test_fault_injection.py::test_kill_9_or_sigterm_during_a_run_then_resume_matches_an_uninterrupted_run.
"""

import os
import signal
import time

import pytest

from diffrl.controller.stopping import (
    Interrupted,
    resume_command,
    stop_message,
    stop_requested,
    stop_signals,
    stops_at_safe_points,
)

COMMAND = [
    "diffrl",
    "train",
    "tiny_sd3",
    "trainer.total_steps=8",
    "trainer.run_name=old",
    "trainer.resume=off",
]


def _deliver(signum: int) -> None:
    """Send `signum` to this process; Python runs its handler in the main thread at once after."""
    os.kill(os.getpid(), signum)
    time.sleep(0.01)


def test_outside_the_loop_the_first_signal_stops_at_once_and_the_handlers_are_put_back():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Interrupted) as info, stop_signals(COMMAND) as signals:
        _deliver(signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the block")
    assert (info.value.exit_status, str(info.value)) == (143, "stopped at once by SIGTERM")
    assert isinstance(info.value, KeyboardInterrupt)  # unwinds like Ctrl-C, past `except Exception`
    assert signals.exit_status(3) == 143
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert stop_requested() is None


class Loop:
    """A stand-in for TrainingLoop: `fit` runs `steps` (callables) and records what it saw."""

    def __init__(self, run_dir, steps):
        self.run_dir, self.steps, self.seen = run_dir, steps, []

    @stops_at_safe_points
    def fit(self):
        for step in self.steps:
            step()
            self.seen.append(stop_requested())
        return "done"


def test_in_the_loop_the_first_signal_waits_for_a_safe_point_and_a_second_stops_at_once(tmp_path, capfd):
    run_dir = tmp_path / "my-run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002" / "complete").touch()
    steps = [
        lambda: _deliver(signal.SIGINT),  # Ctrl-C: a request, the loop goes on
        lambda: _deliver(signal.SIGINT),  # the same Ctrl-C forwarded by a wrapper: ignored
        lambda: None,
        lambda: _deliver(signal.SIGTERM),  # a second signal: at once
        lambda: None,
    ]
    loop = Loop(run_dir, steps)
    with stop_signals(COMMAND) as signals:
        with pytest.raises(Interrupted) as info:
            loop.fit()
        assert loop.seen == [signal.SIGINT] * 3  # the loop saw the request at each safe point
        assert stop_message(run_dir / "checkpoints" / "step_00000002", run_dir) == (
            f"SIGINT received: the run stopped with its checkpoint {run_dir}/checkpoints/step_00000002; "
            "resume it with: diffrl train tiny_sd3 trainer.total_steps=8 trainer.run_name=my-run "
            "trainer.resume=auto"
        )
    assert info.value.exit_status == 143 and signals.exit_status(3) == 130  # the first was Ctrl-C
    assert str(info.value) == (
        f"stopped at once by SIGTERM; its newest checkpoint is {run_dir}/checkpoints/step_00000002; "
        "resume it with: diffrl train tiny_sd3 trainer.total_steps=8 trainer.run_name=my-run trainer.resume=auto"
    )
    assert "SIGINT received: the run stops after the current step" in capfd.readouterr().err
    assert stop_requested() is None and stop_message(run_dir, run_dir) is None  # only while it lasts

    # a run stopped at once before its first checkpoint has nothing to resume
    fresh = Loop(tmp_path / "fresh", [lambda: _deliver(signal.SIGINT), lambda: _deliver(signal.SIGTERM)])
    with pytest.raises(Interrupted) as info, stop_signals(COMMAND):
        fresh.fit()
    assert str(info.value) == (
        f"stopped at once by SIGTERM; {tmp_path / 'fresh'} has no checkpoint to resume from: start the "
        "run again under another trainer.run_name"
    )


def test_without_stop_signals_the_loop_is_interrupted_as_before(tmp_path):
    # Python's own SIGINT handling is the premise: set it, since an earlier case in this pytest
    # worker may have left another handler (the suite failed once on a worker whose SIGINT was not
    # Python's default; diffrl's stop_signals puts back what it found, tested above)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        loop = Loop(tmp_path, [lambda: _deliver(signal.SIGINT)])
        with pytest.raises(KeyboardInterrupt) as info:
            loop.fit()
        assert not isinstance(info.value, Interrupted)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_resume_command_names_the_run_and_quotes_what_needs_it(tmp_path):
    command = ["diffrl", "sft", "my run.yaml", "trainer.resume=PATH", "actor.optim.lr=1e-4"]
    assert resume_command(command, tmp_path / "sft-1") == (
        "diffrl sft 'my run.yaml' actor.optim.lr=1e-4 trainer.run_name=sft-1 trainer.resume=auto"
    )
