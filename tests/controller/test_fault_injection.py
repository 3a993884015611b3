"""Fault injection: a `diffrl train` process killed with SIGKILL during the rollout, the update or a
checkpoint save, or sent SIGTERM, then resumed with trainer.resume=auto, logs exactly the metrics of
a run that was never interrupted; a dead worker ends the run with a WorkerError naming it.

The runs are forked from one "zygote" process that has imported diffrl once (imports are most of
a tiny run's time); each child is `diffrl train` (`diffrl.cli.main`) with a hook that sends
SIGKILL to itself, or to a worker, at the chosen point, so the kill lands at the same place every
time (tests/controller/fault_zygote.py, shared with test_fault_injection_gpu.py).
"""

import json
import re
import time
import uuid
from pathlib import Path

import pytest
from fault_zygote import run_until_killed, start_zygote, wait_gone
from in_process_pools import in_process_pools

from diffrl.controller.run import train as run_train
from diffrl.telemetry import read_metrics

ARGS = [
    "tiny_sd3",
    "trainer.total_steps=4",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.check_at_start=false",  # the start-up check is not what these test
]
# wall-clock measurements (the pools' busy and idle shares of a separate placement's step included)
NOT_COMPARABLE = ("timing", "throughput", "perf/", "time", "trainer/wait", "rollout/idle", "rollout/busy")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    yield from start_zygote(tmp_path_factory)


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARABLE) and "seconds" not in k}


def test_kill_9_or_sigterm_during_a_run_then_resume_matches_an_uninterrupted_run(zygote, tmp_path):
    """SIGKILL during the rollout, the update and a checkpoint save, and SIGTERM during a rollout,
    one after the other, each run resumed from the last one's newest checkpoint."""
    start = time.monotonic()
    train = ["train", *ARGS, f"trainer.output_dir={tmp_path}"]
    assert zygote([*train, "trainer.run_name=full"]) == 0, zygote.log.read_text()[-3000:]
    killed = [*train, "trainer.run_name=killed"]
    run_dir = tmp_path / "killed"
    # 2 micro-batches and 2 optimizer steps per step (16 trajectories, mini-batches of 8)
    assert zygote(killed, {"at": "rollout", "call": 4}) == -9  # step 2's second micro-batch
    # SIGTERM in the resumed step 2's first micro-batch, under settings that save no checkpoint
    # there (save_freq=3): step 2 finishes, is logged, saved, and the run exits 143 with one line
    # naming the checkpoint and the resume command
    earlier = len(zygote.log.read_text())
    stopped = [*killed, "trainer.save_freq=3"]
    assert zygote(stopped, {"at": "rollout", "call": 1, "signal": "SIGTERM"}) == 143
    log = zygote.log.read_text()[earlier:]
    assert "SIGTERM received: the run stops after the current step" in log
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    resume = f"diffrl {' '.join(killed[:-1])} trainer.save_freq=3 trainer.run_name=killed trainer.resume=auto"
    assert (
        f"diffrl train: stopped: SIGTERM received: the run stopped with its checkpoint {checkpoint}; "
        f"resume it with: {resume}\n" in log
    ), log[-3000:]
    assert (checkpoint / "complete").is_file() and _steps_of_lines(run_dir) == [1, 2]
    assert zygote(killed, {"at": "update", "call": 2}) == -9  # step 3, after its first optimizer step
    assert zygote(killed, {"at": "save", "call": 2}) == -9  # step 4's checkpoint, weights on disk
    # the interrupted save left at most its hidden temporary folder, never a step_N
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".tmp-")) == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ], "a kill mid-save left something that looks like a checkpoint"
    assert zygote(killed) == 0, zygote.log.read_text()[-3000:]
    expected, got = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4]
    assert _steps_of_lines(run_dir) == [1, 2, 3, 4]  # each step once, in order: nothing lost, nothing doubled
    for step in (1, 2, 3, 4):
        assert comparable(got[step]) == pytest.approx(comparable(expected[step]), rel=1e-6, abs=1e-9), step
    assert time.monotonic() - start < 120


def _steps_of_lines(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's lines, each step's records counted once (a step that saves a
    checkpoint has a second record with the save's time, written after the checkpoint is published)."""
    lines = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [step for i, step in enumerate(lines) if i == 0 or lines[i - 1] != step]


def test_a_kill_between_publishing_a_checkpoint_and_logging_its_step_loses_no_step(zygote, tmp_path):
    """Every step a checkpoint covers is in metrics.jsonl after a resume: the step's record is
    written before its checkpoint is published, so a kill just after the publish loses nothing."""
    train = ["train", *ARGS, "trainer.total_steps=3", f"trainer.output_dir={tmp_path}", "trainer.run_name=k"]
    assert zygote(train, {"at": "saved", "call": 2}) == -9  # step 2's checkpoint published, then killed
    run_dir = tmp_path / "k"
    assert (run_dir / "checkpoints" / "step_00000002" / "complete").is_file()
    assert zygote(train) == 0, zygote.log.read_text()[-3000:]
    assert sorted(read_metrics(run_dir / "metrics.jsonl")) == [1, 2, 3]
    assert _steps_of_lines(run_dir) == [1, 2, 3]
    assert "rewards/mean" in read_metrics(run_dir / "metrics.jsonl")[2]


@pytest.mark.parametrize(
    ("kill", "message"),
    [
        (
            "actor",
            r"HybridWorker rank 1 \(of 2\) on node \S+ \(pid \d+\) died (during|while idle \(its last call:) HybridWorker\.[\w.]+\)?: \w*Actor",
        ),
        (
            "reward",
            r"RewardWorker rank 0 \(of 1\) on node [0-9.]+ \(pid \d+\) died( during RewardWorker\.score)?: \w*Actor",
        ),
    ],
)
def test_a_dead_worker_ends_the_run_naming_it(zygote, tmp_path, kill, message):
    argv = [
        "train",
        *ARGS,
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=dead",
        "trainer.n_gpus_per_node=2",
        "actor.strategy=fsdp2",
        "reward.workers=1",
        "trainer.loggers=[jsonl]",
    ]
    tag, log = run_until_killed(zygote, argv, {"at": kill}, message)
    assert wait_gone(tag, log, 20) == {}, "processes of the failed run were left behind"
    assert "restarting from" not in log and not (tmp_path / "dead" / "restarts.jsonl").exists()


def test_a_run_with_max_restarts_resumes_after_a_dead_worker_and_logs_the_uninterrupted_metrics(
    zygote, tmp_path
):
    """trainer.max_restarts=1: HybridWorker rank 1 is killed as step 2 starts; the run starts its
    workers again, resumes from step 1's checkpoint and ends as an uninterrupted run does (exit 0,
    the same metrics, each step once), with the restart on the terminal and in restarts.jsonl and
    none of the dead attempt's processes left."""
    two_workers = [
        "train",
        *ARGS,
        f"trainer.output_dir={tmp_path}",
        "trainer.total_steps=3",
        "trainer.n_gpus_per_node=2",
        "actor.strategy=fsdp2",
        "trainer.loggers=[jsonl]",
    ]
    assert zygote([*two_workers, "trainer.run_name=full"]) == 0, zygote.log.read_text()[-3000:]
    tag = f"DIFFRL_FAULT_{uuid.uuid4().hex}"
    earlier = len(zygote.log.read_text())
    restarting = [*two_workers, "trainer.run_name=restarted", "trainer.max_restarts=1"]
    code = zygote(restarting, kill={"at": "actor", "step": 2}, env={tag: "1"})
    log = zygote.log.read_text()[earlier:]
    assert code == 0, log[-3000:]
    assert re.search(
        r"HybridWorker rank 1 on node \S+ \(pid \d+\) died at step 2: restarting from checkpoint step 1 "
        r"\(restart 1 of 1\)",
        log,
    ), log[-3000:]
    run_dir = tmp_path / "restarted"
    (record,) = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (record["restart"], record["failed_step"], record["resumed_step"]) == (1, 2, 1), record
    assert "HybridWorker rank 1 (of 2)" in record["error"], record["error"]
    expected, got = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert _steps_of_lines(run_dir) == [1, 2, 3]  # step 2 of the dead attempt was never logged
    for step in (1, 2, 3):
        assert comparable(got[step]) == pytest.approx(comparable(expected[step]), rel=1e-6, abs=1e-9), step
    assert wait_gone(tag, log, 20) == {}, "processes of the dead attempt were left behind"


RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")

# Separate placement, one step off: trainer rank(s), rollout replicas and reward workers are each
# their own Ray actors, and the next batch's requests stream to the replicas from a driver thread.
SEPARATE = [
    "trainer.placement=separate",
    "trainer.async_mode=one_step_off",
    "rollout.replicas=2",
]


@pytest.mark.parametrize(
    ("kill", "message"),
    [
        # killed while its request of the next batch (step 2's) is queued or sampling
        (
            {"at": "replica", "rank": 0, "when": "streaming"},
            r"RolloutWorker rank 0 \(of 2\) on node \S+ \(pid \d+\) died (during|while idle \(its last call:) RolloutWorker\.\w+[^:]*: \w*(Actor|Owner)",
        ),
        # killed in its weight receive of step 1's first sync, once the first bucket header came:
        # trainer rank 0 is streaming to it (gloo here; NCCL: test_fault_injection_gpu.py)
        (
            {"at": "replica", "rank": 0, "when": "sync"},
            r"RolloutWorker rank 0 \(of 2\) on node \S+ \(pid \d+\) died during RolloutWorker\.receive_weights: \w*Actor",
        ),
        # the weight-sync source: killed before step 1's first sync
        (
            {"at": "trainer", "rank": 0},
            r"ActorWorker rank 0 \(of 1\) on node \S+ \(pid \d+\) died (during|while idle \(its last call:) ActorWorker\.[\w.]+\)?: \w*Actor",
        ),
        (
            {"at": "reward"},
            r"RewardWorker rank 0 \(of 1\) on node [0-9.]+ \(pid \d+\) died( during RewardWorker\.score)?: \w*Actor",
        ),
    ],
    ids=["replica", "replica-sync", "trainer", "reward"],
)
def test_a_dead_actor_ends_a_one_step_off_run_naming_it(zygote, tmp_path, kill, message):
    # A replica's death is tested among two replicas (the other one lives on); the trainer's and
    # the reward worker's with one replica (each actor started is ~10 s of imports on 2 cores)
    argv = [
        "train",
        *ARGS,
        *SEPARATE,
        *([] if kill["at"] == "replica" else ["rollout.replicas=1"]),
        "trainer.save_freq=0",  # a step ending with a checkpoint starts no next batch
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=dead",
        "reward.workers=1",
        "trainer.loggers=[jsonl]",
    ]
    tag, log = run_until_killed(zygote, argv, kill, message)
    assert wait_gone(tag, log, 20) == {}, "processes of the failed run were left behind"


def test_kill_9_mid_step_in_one_step_off_mode_then_resume_matches_an_uninterrupted_run(
    zygote, tmp_path, monkeypatch
):
    """Checkpoints at steps 2 and 4: step 3 samples its own batch and starts step 4's, step 4
    trains on that in-flight batch. A kill in step 3 and another in step 4 (the in-flight batch
    lost with the driver) resume from step 2 and log what the uninterrupted run logged. That
    run's pools are in this process (tests/controller/in_process_pools.py, whose metrics
    test_bounded.py checks against Ray's): a Ray run would start Ray and two model workers."""
    start = time.monotonic()
    train = [
        "train",
        *ARGS,
        *SEPARATE,
        "rollout.replicas=1",
        "trainer.save_freq=2",
        "trainer.total_steps=4",
        "trainer.resume=auto",
        f"trainer.output_dir={tmp_path}",
    ]
    killed = [*train, "trainer.run_name=killed"]
    # the driver's update of a step (the trainer ranks step the optimizer in their own processes)
    kills = []
    for call in (3, 2):  # step 3 of the first run; step 4 of the run resumed at step 2
        tag = f"DIFFRL_FAULT_{uuid.uuid4().hex}"
        assert zygote(killed, {"at": "driver_update", "call": call}, env={tag: "1"}) == -9
        kills.append((tag, zygote.log.read_text(), time.monotonic()))
        # Ray's GCS and raylet share the driver's fate, and the workers the raylet's. Its dashboard
        # and runtime-env agents see the raylet die at once but first report that to the GCS,
        # which is gone too: they exit when that call times out (Ray's, about a minute).
        left = wait_gone(tag, kills[-1][1], 20, ignore=RAY_AGENTS)
        assert left == {}, f"the killed driver left processes (kill at update {call}): {left}"
    run_dir = tmp_path / "killed"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    # the uninterrupted run after the kills: Ray's agents of the killed drivers end meanwhile
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("diffrl.controller.run.placement_session", in_process_pools)
    run_train(train[1], [*train[2:], "trainer.run_name=full"])
    assert zygote(killed) == 0, zygote.log.read_text()[-3000:]
    expected, got = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert _steps_of_lines(run_dir) == [1, 2, 3, 4]
    # one step off from step 2 on, also in the resumed steps: step 4 trained on a batch step 3 sampled
    assert [got[step]["rollout/staleness"] for step in (1, 2, 3, 4)] == [0, 1, 0, 1]
    for step in (1, 2, 3, 4):
        # weight_sync/* records the transfer, not the weights: the resumed run's first sync (the
        # checkpoint's weights, all tensors) happens at the resume, the uninterrupted run's step 3
        # sends its adapters only
        assert {k: v for k, v in comparable(got[step]).items() if not k.startswith("weight_sync/")} == (
            pytest.approx(
                {k: v for k, v in comparable(expected[step]).items() if not k.startswith("weight_sync/")},
                rel=1e-6,
                abs=1e-9,
            )
        ), step
    # Ray's agents of the first kill end within Ray's minute; the second kill's end the same way,
    # a minute after it (waiting for them too would add that minute of idle time to the suite).
    tag, log, killed_at = kills[0]
    left = wait_gone(tag, log, killed_at + 120 - time.monotonic())
    assert left == {}, f"Ray's processes outlived the killed driver by 120 s: {left}"
    print(f"\nkill -9 and resume, one_step_off: {time.monotonic() - start:.0f} s")
