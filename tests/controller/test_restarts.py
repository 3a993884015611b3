"""trainer.max_restarts without Ray: which failures restart a run (a worker's death only), how many
times, from which checkpoint, and what each restart records. The end-to-end case (a worker
SIGKILLed mid-run, the run resumed with the uninterrupted run's metrics) is in
tests/controller/test_fault_injection.py."""

import json
import signal

import pytest

from diffrl.config import load_config
from diffrl.controller import stopping
from diffrl.controller.restarts import RESTARTS_FILE, run_with_restarts, worker_death
from diffrl.workers.errors import WorkerError, WorkerIdentity


class RayActorError(RuntimeError):
    """Named as Ray's: `WorkerError.process_failed` looks at the cause's class name, so the
    classification is tested without starting Ray."""


IDENTITY = WorkerIdentity(rank=1, cls_name="HybridWorker", node_ip="127.0.0.1", node_id="n", pid=4242)


def died():
    return WorkerError(1, 2, "HybridWorker.rollout", RayActorError("the actor died"), identity=IDENTITY)


def raised():
    return WorkerError(0, 2, "HybridWorker.rollout", ValueError("a reward returned nan"))


def config(tmp_path, restarts):
    return load_config("tiny_sd3", [f"trainer.output_dir={tmp_path}", f"trainer.max_restarts={restarts}"])


@pytest.mark.parametrize(
    ("error", "dead"),
    [
        (died(), True),
        (RuntimeError("step failed"), False),
        (raised(), False),  # a method that raised is no death
        (KeyboardInterrupt(), False),
    ],
)
def test_only_a_dead_worker_counts_as_a_death(error, dead):
    assert (worker_death(error) is not None) == dead


def test_a_death_found_under_another_error_counts():
    try:
        try:
            raise died()
        except WorkerError as inner:
            raise RuntimeError("the step's rollout failed") from inner
    except RuntimeError as outer:
        assert worker_death(outer) is not None


def test_a_stop_signal_received_meanwhile_is_no_death(monkeypatch):
    monkeypatch.setattr(stopping, "_active", type("Active", (), {"requested": signal.SIGTERM})())
    assert worker_death(died()) is None


class Loop:
    def __init__(self, step):
        self.step = step


def test_restarts_resume_from_the_newest_checkpoint_up_to_the_limit_then_the_error_propagates(
    tmp_path, monkeypatch
):
    cfg = config(tmp_path, 2)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    newest = iter([run_dir / "checkpoints" / "step_3", None])
    monkeypatch.setattr("diffrl.controller.restarts.latest_checkpoint", lambda root: next(newest))
    monkeypatch.setattr("diffrl.controller.restarts.checkpoint_step", lambda c: 0 if c is None else 3)
    calls = []

    def attempt(checkpoint, state):
        calls.append((checkpoint, state["restarted"]))
        state["loop"] = Loop(4 + len(calls))
        raise died()

    with pytest.raises(WorkerError, match="HybridWorker rank 1"):
        run_with_restarts(cfg, run_dir, None, attempt)
    assert calls == [(None, False), (run_dir / "checkpoints" / "step_3", True), (None, True)]
    records = [json.loads(line) for line in (run_dir / RESTARTS_FILE).read_text().splitlines()]
    assert [(r["restart"], r["of"], r["failed_step"], r["resumed_step"]) for r in records] == [
        (1, 2, 5, 3),
        (2, 2, 6, 0),
    ]
    assert all("HybridWorker rank 1 (of 2)" in r["error"] for r in records)


def test_without_the_setting_a_death_ends_the_run_and_nothing_is_recorded(tmp_path):
    cfg = config(tmp_path, 0)
    calls = []

    def attempt(checkpoint, state):
        calls.append(checkpoint)
        raise died()

    with pytest.raises(WorkerError):
        run_with_restarts(cfg, tmp_path, None, attempt)
    assert calls == [None] and not (tmp_path / RESTARTS_FILE).exists()


def test_an_error_that_is_no_death_is_not_restarted(tmp_path):
    cfg = config(tmp_path, 3)
    calls = []

    def attempt(checkpoint, state):
        calls.append(checkpoint)
        raise raised()

    with pytest.raises(WorkerError, match="nan"):
        run_with_restarts(cfg, tmp_path, None, attempt)
    assert calls == [None]


def test_a_restarted_attempt_that_finishes_returns_its_result(tmp_path, monkeypatch, capsys):
    cfg = config(tmp_path, 1)
    monkeypatch.setattr("diffrl.controller.restarts.latest_checkpoint", lambda root: None)
    outcomes = iter([died(), "done"])

    def attempt(checkpoint, state):
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert run_with_restarts(cfg, tmp_path, None, attempt) == "done"
    assert "died before its first step: restarting from step 0 (no checkpoint yet) (restart 1 of 1)" in (
        capsys.readouterr().out
    )


def test_max_restarts_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.max_restarts"):
        config(tmp_path, -1)
