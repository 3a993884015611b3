"""The rollout pipeline with staleness bound K (diffrl/controller/pipeline.py): sync is K = 0,
one_step_off K = 1, trainer.async_mode=bounded any K.

The expected weight versions come from the schedule written out here, v(j) = max(c, j − 1 − K)
with c the last checkpoint step before j, not from the code under test. The runs use the separate
placement's pools in this process (tests/controller/in_process_pools.py: a tiny run takes
seconds); one test runs the same job on Ray actors with two replicas and gets the same metrics.
"""

from __future__ import annotations

import json
import math
import random
import textwrap
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fault_zygote import serve_zygote
from in_process_pools import in_process_pools

from diffrl.controller.pipeline import RolloutPipeline
from diffrl.controller.policy_gradient import PolicyGradientTrainer
from diffrl.controller.run import train
from diffrl.telemetry import read_metrics as diffrl_read_metrics
from diffrl.workers.roles import ActorWorker, RolloutWorker

HERE = Path(__file__).parent

BOUNDED = [
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "trainer.placement=separate",
    "trainer.async_mode=bounded",
    "rollout.replicas=1",
]
# wall-clock measurements; weight_sync/* records transfers (a resumed run's first sync is a full one)
NOT_COMPARABLE = ("timing", "throughput", "perf/", "time", "trainer/wait", "rollout/idle", "rollout/busy")


@pytest.fixture(autouse=True)
def in_process(monkeypatch, tmp_path):
    # one compute thread, as in a Ray worker of a CPU run; the pools in this process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("diffrl.controller.run.placement_session", in_process_pools)


def expected_version(step: int, k: int, checkpoints: list[int]) -> int:
    """The version batch `step` is sampled with: K behind, never before the last checkpoint."""
    last_checkpoint = max([c for c in checkpoints if c < step], default=0)
    return max(last_checkpoint, step - 1 - k)


def checkpoint_steps(total: int, save_freq: int) -> list[int]:
    return sorted({*(range(save_freq, total + 1, save_freq) if save_freq else ()), total})


def comparable(row: dict, also: tuple[str, ...] = ()) -> dict:
    skip = NOT_COMPARABLE + also
    return {k: v for k, v in row.items() if not k.startswith(skip) and "seconds" not in k and k != "step"}


def read_metrics(run_dir: Path) -> dict[int, dict]:
    return diffrl_read_metrics(run_dir / "metrics.jsonl")


# ---------------------------------------------------------------------------- the schedule alone
class FakeReplicas:
    """The separate placement's queue as the pipeline sees it: samples and weight deliveries run
    in the order queued, each call letting the replicas get a random distance through the queue
    (so the pipeline meets every interleaving of the two sides)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.queue: deque = deque()
        self.held: int | None = None
        self.sampled: list[tuple[int, int, int]] = []  # (step, scheduled version, version held)

    def run(self, jobs: int) -> None:
        for _ in range(min(jobs, len(self.queue))):
            kind, item = self.queue.popleft()
            if kind == "deliver":
                self.held = item
            else:
                item.held = self.held
                self.sampled.append((item.step, item.version, self.held))

    def advance(self) -> None:
        self.run(self.rng.randint(0, 3))

    def sync_weights(self, version: int, *, full: bool = False) -> dict[str, float]:
        assert not self.queue, "a direct sync while samples or deliveries are queued"
        self.held = version
        return {}

    def publish_weights(self, version: int) -> dict[str, float]:
        self.advance()
        self.queue.append(("deliver", version))
        return {}

    def drain(self) -> None:
        self.run(len(self.queue))

    def sample(self, records: list[int], step: int, version: int, passes: tuple) -> FakePending:
        self.advance()
        pending = FakePending(self, step, version, records)
        self.queue.append(("sample", pending))
        return pending


class FakePending:
    def __init__(self, replicas: FakeReplicas, step: int, version: int, records: list[int]):
        self.replicas, self.step, self.version, self.records = replicas, step, version, records
        self.held: int | None = None

    def result(self) -> SimpleNamespace:
        while self.held is None:
            self.replicas.run(1)
        versions = torch.full((4,), self.held, dtype=torch.long)
        return SimpleNamespace(summary=SimpleNamespace(extras={"weight_version_B": versions}))


def run_schedule(
    k: int, total: int, save_freq: int, test_freq: int, seed: int, kill_after: int | None = None
):
    """Drive the pipeline through `total` steps; with `kill_after`, lose everything after that
    step and start again from the last checkpoint, as a resumed run does. Returns per step the
    prompts trained on, the version sampled with and the batches in flight."""
    rng = random.Random(seed)
    checkpoints = checkpoint_steps(total, save_freq)

    def horizon(step: int) -> int:
        return min(c for c in checkpoints if c >= step)

    def start(at_step: int):
        replicas = FakeReplicas(rng)
        drawn = iter(range(at_step, total + 10))  # the data sampler's position: one batch per step
        pipeline = RolloutPipeline(replicas, k, draw=lambda: [next(drawn)], horizon=horizon)  # type: ignore[arg-type]
        return replicas, pipeline

    replicas, pipeline = start(1)
    log: dict[int, tuple[list[int], int, int]] = {}
    step = 1
    while step <= total:
        records, staged, metrics, _ = pipeline.take(step, replicas.sample)
        versions = staged.summary.extras["weight_version_B"]
        log[step] = (records, int(versions[0]), int(metrics["async/in_flight"]))
        for sampled_step, scheduled, held in replicas.sampled:
            assert scheduled == held, f"batch {sampled_step} sampled with {held}, scheduled {scheduled}"
        if test_freq and step % test_freq == 0:
            pipeline.sync_for_validation(step)
        if step == kill_after:
            kill_after = None
            step = max([c for c in checkpoints if c <= step], default=0) + 1
            replicas, pipeline = start(step)
            continue
        step += 1
    return log


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize(("save_freq", "test_freq"), [(0, 0), (4, 0), (3, 2), (5, 3)])
def test_the_schedule_keeps_every_batch_within_k_versions_whatever_the_replicas_timing(
    k, save_freq, test_freq
):
    total = 9
    checkpoints = checkpoint_steps(total, save_freq)
    runs = [run_schedule(k, total, save_freq, test_freq, seed) for seed in range(4)]
    for step in range(1, total + 1):
        records, version, in_flight = runs[0][step]
        assert records == [step], "batches are drawn and trained in step order"
        assert version == expected_version(step, k, checkpoints), step
        assert 0 <= step - 1 - version <= k
        next_checkpoint = min(c for c in checkpoints if c >= step)
        assert in_flight == min(k, next_checkpoint - step), step
    # the replicas' progress (different at each seed) changes nothing
    assert all(run == runs[0] for run in runs[1:])


@pytest.mark.parametrize("kill_after", [1, 4, 5, 7, 8])
def test_after_a_restart_from_the_last_checkpoint_the_schedule_is_the_uninterrupted_ones(kill_after):
    uninterrupted = run_schedule(2, 9, 4, 0, seed=0)
    assert run_schedule(2, 9, 4, 0, seed=1, kill_after=kill_after) == uninterrupted


# ---------------------------------------------------------------------------- runs
def test_each_batch_is_sampled_with_the_weights_of_its_scheduled_version(tmp_path, monkeypatch):
    """K = 2 over 7 steps, a checkpoint at step 5, validations at steps 3, 6 and 7 (with batches in
    flight): every request a replica samples names the scheduled version, the replica holds the
    trainer's weights of that version bitwise, and the metrics say so."""
    k, total, save_freq = 2, 7, 5
    trainer_digests: dict[int, dict] = {}
    sampled: list[tuple[int, int, dict]] = []
    train_step, sample = PolicyGradientTrainer.train_step, RolloutWorker.sample_and_score

    def recording_train_step(self):
        # the weights the step starts from: version step - 1
        trainer_digests[self.step - 1] = self.workers.workers[0].weights.digest()
        return train_step(self)

    def recording_sample(self, shard, **kwargs):
        sampled.append((kwargs["step"], kwargs["version"], self.weight_digest()))
        # a slow replica: the deliveries of version k - 1 happen after the trainer trained step k
        time.sleep(0.2)
        return sample(self, shard, **kwargs)

    monkeypatch.setattr(PolicyGradientTrainer, "train_step", recording_train_step)
    monkeypatch.setattr(RolloutWorker, "sample_and_score", recording_sample)
    run_dir = train(
        "tiny_sd3",
        [
            *BOUNDED,
            f"trainer.max_staleness={k}",
            f"trainer.total_steps={total}",
            f"trainer.save_freq={save_freq}",
            "trainer.test_freq=3",
            f"trainer.output_dir={tmp_path}",
            # the trainer recomputes at the replica's micro-batch: CPU matmul kernels may round
            # differently at other batch sizes, and the gap is compared with 0
            "actor.micro_batch_size=8",
        ],
    )
    checkpoints = checkpoint_steps(total, save_freq)
    versions = [expected_version(step, k, checkpoints) for step in range(1, total + 1)]
    assert versions == [0, 0, 0, 1, 2, 5, 5]  # the schedule, written out
    assert sorted({step for step, _, _ in sampled}) == list(range(1, total + 1))
    assert len(sampled) == 2 * total  # two requests a batch, each sampled once
    for step, version, digest in sampled:
        assert version == versions[step - 1], step
        assert digest == trainer_digests[version], f"batch {step} was not sampled with version {version}"
    metrics = read_metrics(run_dir)
    staleness = [metrics[step]["async/staleness"] for step in range(1, total + 1)]
    assert staleness == [0, 1, 2, 2, 2, 0, 1]
    assert max(metrics[step]["async/staleness_max"] for step in metrics) <= k
    assert [metrics[step]["rollout/weight_version"] for step in range(1, total + 1)] == versions
    assert [metrics[step]["async/in_flight"] for step in range(1, total + 1)] == [2, 2, 2, 1, 0, 1, 0]
    for step in range(1, total + 1):
        gap = metrics[step]["rollout_correction/abs_logp_diff_max"]
        # the trainer recomputes with the weights the step starts from: the sampler's log-probs
        # are the same numbers on the same weights, and differ from stale ones
        assert (gap == 0) == (metrics[step]["async/staleness"] == 0), (step, gap)
        assert math.isfinite(metrics[step]["actor/loss"])
    assert all("val/rewards/mean" in metrics[step] for step in (3, 6, 7))


def test_bounded_runs_log_the_same_metrics_whichever_side_is_slower(tmp_path, monkeypatch):
    """The same seed gives the same run when the trainer waits for the replicas, and when the
    replicas run K batches ahead and wait for weights: the versions follow the schedule, not the
    clock."""
    args = [*BOUNDED, "trainer.max_staleness=2", "trainer.total_steps=5", "trainer.save_freq=0"]
    args += ["trainer.test_freq=0", f"trainer.output_dir={tmp_path}"]
    optim_step, sample = ActorWorker.optim_step, RolloutWorker.sample_and_score

    def slow_optim_step(self):
        time.sleep(0.3)
        return optim_step(self)

    def slow_sample(self, *args, **kwargs):
        time.sleep(0.3)
        return sample(self, *args, **kwargs)

    runs = {"plain": read_metrics(train("tiny_sd3", [*args, "trainer.run_name=plain"]))}
    with monkeypatch.context() as patch:
        patch.setattr(ActorWorker, "optim_step", slow_optim_step)
        runs["slow_trainer"] = read_metrics(train("tiny_sd3", [*args, "trainer.run_name=slow_trainer"]))
    with monkeypatch.context() as patch:
        patch.setattr(RolloutWorker, "sample_and_score", slow_sample)
        runs["slow_replica"] = read_metrics(train("tiny_sd3", [*args, "trainer.run_name=slow_replica"]))
    assert sorted(runs["plain"]) == [1, 2, 3, 4, 5]
    assert [runs["plain"][step]["async/staleness"] for step in range(1, 6)] == [0, 1, 2, 2, 2]
    for name in ("slow_trainer", "slow_replica"):
        assert sorted(runs[name]) == [1, 2, 3, 4, 5]
        for step in range(1, 6):
            assert comparable(runs[name][step]) == comparable(runs["plain"][step]), (name, step)


def test_bounded_with_a_staleness_of_one_trains_as_one_step_off(tmp_path):
    """K = 1 is one_step_off's schedule: the same metrics, validation and KL included (one_step_off
    recomputes the old log-probs on the replica, bounded on the trainer: bitwise the same here)."""
    args = ["trainer.total_steps=4", "trainer.save_freq=0", "trainer.test_freq=2", "actor.loss.kl_coef=0.01"]
    args += [*BOUNDED[:-2], "rollout.replicas=1", f"trainer.output_dir={tmp_path}"]
    bounded = read_metrics(
        train(
            "tiny_sd3", [*args, "trainer.async_mode=bounded", "trainer.max_staleness=1", "trainer.run_name=b"]
        )
    )
    one_step_off = read_metrics(
        train("tiny_sd3", [*args, "trainer.async_mode=one_step_off", "trainer.run_name=o"])
    )
    assert sorted(bounded) == sorted(one_step_off) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        # one_step_off syncs before its last step although nothing samples after it; bounded does not
        ours = comparable(bounded[step], also=("weight_sync/", "async/in_flight"))
        theirs = comparable(one_step_off[step], also=("weight_sync/",))
        assert ours == theirs, step
    assert [bounded[step]["async/staleness"] for step in (1, 2, 3, 4)] == [0, 1, 1, 1]


def test_bounded_on_ray_with_two_replicas_logs_what_the_in_process_pools_log(
    tmp_path, monkeypatch, shared_ray
):
    """The real pools (Ray actors, two replicas taking requests as they free up, a gloo weight
    sync between processes) give the in-process run's metrics: the harness above is faithful.
    The Ray run joins the tests' shared cluster (tests/conftest.py), whose actors read its cache."""
    monkeypatch.setenv("DIFFRL_CACHE", str(shared_ray))
    args = [*BOUNDED[:-1], "trainer.max_staleness=2", "trainer.total_steps=4", "trainer.save_freq=0"]
    args += ["trainer.test_freq=2", f"trainer.output_dir={tmp_path}"]
    in_process = read_metrics(train("tiny_sd3", [*args, "rollout.replicas=1", "trainer.run_name=local"]))
    monkeypatch.undo()  # the real placement_session
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(shared_ray))
    on_ray = read_metrics(
        train(
            "tiny_sd3",
            [*args, "rollout.replicas=2", "rollout.requests_in_flight=1", "trainer.run_name=ray"],
        )
    )
    assert sorted(on_ray) == sorted(in_process) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert comparable(on_ray[step]) == comparable(in_process[step]), step
    assert [on_ray[step]["async/staleness"] for step in (1, 2, 3, 4)] == [0, 1, 2, 2]


# ---------------------------------------------------------------------------- kill -9 and resume
ZYGOTE = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, {here!r})
    import diffrl.cli
    from diffrl.controller.policy_gradient import PolicyGradientTrainer
    from in_process_pools import use_in_process_pools

    def kill_at_update(call):
        # SIGKILL this process as the driver enters its call-th step update
        original, calls = PolicyGradientTrainer._update, [0]

        def wrapped(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)

        PolicyGradientTrainer._update = wrapped

    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)
            use_in_process_pools()
            if job["kill"] is not None:
                kill_at_update(job["kill"])
            try:
                code = diffrl.cli.main(job["argv"])
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({{"status": os.waitstatus_to_exitcode(status)}}), flush=True)
    """
)


@pytest.fixture
def zygote(tmp_path):
    """`diffrl <argv>` in a child forked from a process that imported diffrl once; returns its
    exit code (-9 when it was SIGKILLed at update `kill`)."""
    env = {"DIFFRL_CACHE": str(tmp_path / "cache")}
    yield from serve_zygote(ZYGOTE.format(here=str(HERE)), env, tmp_path / "children.log")


def _steps_of_lines(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's lines, each step's records counted once."""
    lines = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [step for i, step in enumerate(lines) if i == 0 or lines[i - 1] != step]


def test_kill_9_with_batches_in_flight_then_resume_matches_an_uninterrupted_run(zygote, tmp_path):
    """K = 2, checkpoints at steps 3 and 6. A kill in step 5 (batch 6 in flight, sampled with
    version 3) and, after resuming from step 3, another in step 4 (batches 5 and 6 in flight) lose
    those batches with the driver; the resumed run samples them again with the same versions and
    logs exactly what the uninterrupted run logged."""
    start = time.monotonic()
    train_args = ["train", "tiny_sd3", *BOUNDED, "trainer.max_staleness=2", "trainer.total_steps=6"]
    train_args += [
        "trainer.save_freq=3",
        "trainer.test_freq=0",
        "trainer.resume=auto",
        f"trainer.output_dir={tmp_path}",
    ]
    assert zygote([*train_args, "trainer.run_name=full"]) == 0, zygote.log.read_text()[-3000:]
    killed = [*train_args, "trainer.run_name=killed"]
    assert zygote(killed, kill=5) == -9  # step 5 of the first run
    assert zygote(killed, kill=1) == -9  # step 4 of the run resumed at step 3
    run_dir = tmp_path / "killed"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert zygote(killed) == 0, zygote.log.read_text()[-3000:]
    expected, got = read_metrics(tmp_path / "full"), read_metrics(run_dir)
    assert _steps_of_lines(run_dir) == [1, 2, 3, 4, 5, 6]
    assert [got[step]["async/staleness"] for step in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    for step in range(1, 7):
        # weight_sync/* records the transfer: the resumed run's first sync (every tensor) is at the resume
        assert comparable(got[step], also=("weight_sync/",)) == comparable(
            expected[step], also=("weight_sync/",)
        ), step
    print(f"\nkill -9 and resume, bounded: {time.monotonic() - start:.0f} s")
