"""`diffrl train`: check everything cheap first, resolve the run plan, then start workers and run the loop.

Order matters for users: a config typo, a missing model directory, an empty prompt file or an
unknown reward is reported before Ray or any model starts, and nothing is written for a run that
cannot start. The run plan (diffrl.config.plan: the parallel strategy, where each pass runs, the
staleness K, attention, compile, offload) is resolved once, before any worker starts
(`preflight.run_plan`), printed as a block after the run's first line, handed to every worker and
loop, and kept as RUN/plan.json once the run has started (`run_loop`); the config is not changed.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from diffrl.algos import DIRECT_PREFERENCE
from diffrl.algos.spec import worker_options
from diffrl.config import load_config, to_yaml
from diffrl.config.history import CONFIG_FILE, record_config
from diffrl.config.loader import resolve_source
from diffrl.config.plan import PLAN_FILE, RunPlan
from diffrl.config.schema import Config, ConfigError
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.placement import Colocated, Placement, Separate
from diffrl.controller.policy_gradient import PolicyGradientTrainer
from diffrl.controller.preflight import preflight, run_plan
from diffrl.files import (
    naming,
    write_json,
)
from diffrl.telemetry.health import HealthStop
from diffrl.train.best_checkpoint import best_checkpoint
from diffrl.train.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint
from diffrl.train.export import export_final_weights
from diffrl.workers.group import WorkerGroup

LOCK_FILE = ".lock"


def find_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    resume = cfg.trainer.resume
    if resume == "off":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints") if run_dir.exists() else None
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} does not exist: give a checkpoint directory, auto or off"
        )
    return path


def check_checkpoint(cfg: Config, path: Path, verified: bool = False) -> None:
    """The checkpoint to resume from verifies against its manifest (unless `verified`: then
    `latest_checkpoint` just did) and was saved with this config's LoRA settings: both read from
    small files before any model loads (the load itself would find a mismatch minutes later)."""
    meta = json.loads((path / "meta.json").read_text()) if verified else verify_checkpoint(path)
    rank, alpha = cfg.model.lora.rank, cfg.model.lora.alpha
    if "trainable_only" in meta and bool(meta["trainable_only"]) != (rank > 0):
        saved = "LoRA adapters" if meta["trainable_only"] else "full-model weights"
        raise ValueError(
            f"checkpoint {str(path)!r} holds {saved} but model.lora.rank={rank} "
            f"({'LoRA' if rank > 0 else 'full fine-tuning'}): use the run's own model.lora settings to "
            "resume it, or start a new run (another trainer.run_name, or trainer.resume=off)"
        )
    for name, adapter in (meta.get("adapters") or {}).items():
        if not isinstance(adapter, dict):
            continue
        for key, field, value in (("r", "rank", rank), ("lora_alpha", "alpha", alpha)):
            saved = adapter.get(key)
            if saved is not None and float(saved) != float(value):
                raise ValueError(
                    f"checkpoint {str(path)!r} was saved with model.lora.{field}={saved} (adapter {name!r}) "
                    f"but the config has model.lora.{field}={value}: set model.lora.{field}={saved} to resume "
                    "it, or start a new run (another trainer.run_name, or trainer.resume=off)"
                )


@contextmanager
def _job_processes(cfg: Config, model_workers: int, use_ray: bool) -> Iterator[Any]:
    """Split the cores over the job's processes (diffrl/workers/threads.py) and, with Ray, start
    or join the cluster; undo both on exit. Yields the thread plan."""
    from diffrl.workers.ray_group import ensure_ray
    from diffrl.workers.threads import plan_threads, set_threads

    threads = plan_threads(model_workers, cfg.reward.workers if use_ray else 0, ray=use_ray)
    restore_threads = set_threads(threads.driver)
    started_ray = False
    try:
        if use_ray:
            # Ray's CPU counts are bookkeeping: declare enough for every worker even on a 2-core laptop.
            reward_cpus = cfg.reward.workers * cfg.reward.cpus_per_worker
            address = cfg.trainer.ray_address
            started_ray = ensure_ray(
                address, num_cpus=None if address else int(model_workers + reward_cpus + 1)
            )
        yield threads
    finally:
        if started_ray:
            import ray

            ray.shutdown()
        restore_threads()


def _start_rewards(cfg: Config, use_ray: bool, threads: Any) -> tuple[Any, Callable[[], None] | None]:
    """The reward workers and their close; None without reward functions (offline DPO may run
    without rewards: no validation then)."""
    from diffrl.workers.reward_workers import create_reward_workers
    from diffrl.workers.threads import thread_env

    if not cfg.reward.functions:
        return None, None
    rewards = create_reward_workers(cfg.reward, use_ray=use_ray, env_vars=thread_env(threads.reward))
    return rewards, rewards.close


def _start_together(
    stack: ExitStack, *starts: Callable[[], tuple[Any, Callable[[], None] | None]]
) -> list[Any]:
    """Run each `start` (returning what it started and its close) in a thread of its own; close
    every started one with `stack`, also when another start failed; then re-raise the first failure.

    Why: each Ray pool's start waits for its actors' constructors, which import torch and load the
    model (tens of seconds on a GPU host for a real model, seconds on a laptop); the trainer pool, the
    rollout pool and the reward workers do not depend on each other, so their starts overlap."""
    if len(starts) == 1:  # nothing to overlap: in the caller's thread (an in-process worker's home)
        value, close = starts[0]()
        if close is not None:
            stack.callback(close)
        return [value]
    executor = concurrent.futures.ThreadPoolExecutor(len(starts), thread_name_prefix="diffrl-start")
    futures = [executor.submit(start) for start in starts]
    try:
        concurrent.futures.wait(futures)
    finally:
        executor.shutdown(wait=True)  # also on Ctrl-C: each start ends within its own deadline
        started, failures = [], []
        for future in futures:
            if future.exception() is not None:
                failures.append(future.exception())
                started.append(None)
                continue
            value, close = future.result()
            if close is not None:
                stack.callback(close)
            started.append(value)
    if failures:
        raise failures[0]
    return started


@contextmanager
def worker_session(cfg: Config, plan: RunPlan | None = None) -> Iterator[tuple[WorkerGroup, Any]]:
    """Start the workers (Ray when several, or in-process) and the reward workers, each handed
    `plan` (resolved here for an eval job when not given); stop them all on exit, also when
    starting one of them failed."""
    from diffrl.telemetry.console import progress
    from diffrl.workers.group import InProcessGroup
    from diffrl.workers.ray_group import RayGroup
    from diffrl.workers.roles import HybridWorker
    from diffrl.workers.threads import thread_env

    world = cfg.world_size
    use_ray = world > 1 or cfg.trainer.ray_address is not None
    roles = {**worker_options(cfg), "plan": plan or run_plan(cfg, "eval")}
    with ExitStack() as stack:
        with progress(f"starting {world} worker(s) and loading {cfg.model.path}"):
            threads = stack.enter_context(_job_processes(cfg, world, use_ray))

            def start_workers() -> tuple[WorkerGroup, Callable[[], None]]:
                if use_ray:
                    gpus = 1.0 if torch.cuda.is_available() else 0.0
                    workers = RayGroup(
                        HybridWorker,
                        world,
                        cfg,
                        num_cpus=1.0,
                        num_gpus=gpus,
                        env_vars=thread_env(threads.worker),
                        **roles,
                    )
                else:
                    workers = InProcessGroup(HybridWorker, 1, cfg, synchronous=True, **roles)
                workers.timeout_s = cfg.trainer.worker_timeout_s
                return workers, workers.shutdown

            def start_rewards() -> tuple[Any, Callable[[], None] | None]:
                return _start_rewards(cfg, use_ray, threads)

            if use_ray:  # the model workers and the reward workers start at once
                workers, rewards = _start_together(stack, start_workers, start_rewards)
            else:
                (workers,) = _start_together(stack, start_workers)
        if not use_ray:  # in this process, in turn
            (rewards,) = _start_together(stack, start_rewards)
        yield workers, rewards


@contextmanager
def placement_session(cfg: Config, plan: RunPlan | None = None) -> Iterator[tuple[Placement, Any]]:
    """`worker_session` for an RL run (`plan`: its run plan, resolved here when not given): the
    colocated pool, or (trainer.placement=separate) a trainer pool and a rollout pool on Ray,
    their weight-sync group joined; stops them all on exit."""
    plan = plan or run_plan(cfg)
    if plan.placement == "colocated":
        with worker_session(cfg, plan) as (workers, rewards):
            yield Colocated(cfg, workers), rewards
        return
    from diffrl.telemetry.console import progress
    from diffrl.workers.ray_group import RayGroup
    from diffrl.workers.roles import ActorWorker, RolloutWorker
    from diffrl.workers.threads import thread_env

    world, replicas = cfg.world_size, cfg.rollout.replicas
    has_gpu = torch.cuda.is_available()
    roles = worker_options(cfg)
    with ExitStack() as stack:
        with progress(
            f"starting {world} trainer rank(s) and {replicas} rollout replica(s) of {cfg.model.path}"
        ):
            threads = stack.enter_context(_job_processes(cfg, world + replicas, use_ray=True))

            def pool(cls: type, size: int, gpus: float, resources: dict, **options: Any):
                def start() -> tuple[RayGroup, Callable[[], None]]:
                    group = RayGroup(
                        cls,
                        size,
                        cfg,
                        num_cpus=1.0,
                        num_gpus=gpus if has_gpu else 0.0,
                        resources=resources,
                        env_vars=thread_env(threads.worker),
                        **options,
                    )
                    group.timeout_s = cfg.trainer.worker_timeout_s
                    return group, group.shutdown

                return start

            trainer, rollout, rewards = _start_together(
                stack,
                pool(
                    ActorWorker,
                    world,
                    cfg.trainer.gpus_per_worker,
                    cfg.trainer.ray_resources,
                    **roles,
                    plan=plan,
                ),
                pool(
                    RolloutWorker,
                    replicas,
                    cfg.rollout.gpus_per_replica,
                    cfg.rollout.ray_resources,
                    with_old=bool(roles.get("with_old", False)),
                ),
                lambda: _start_rewards(cfg, True, threads),
            )
            placement = Separate(cfg, trainer, rollout, backend=plan.weight_sync_backend)
            stack.callback(placement.shutdown)
        yield placement, rewards


def _lock(run_dir: Path) -> int:
    """Hold RUN/.lock exclusively (flock) for as long as this process owns the run; returns the fd.

    The OS drops the lock when the process ends, however it ends, so a kill -9 leaves no stale lock.
    The file holds the owner's PID, for the message another start gets."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # FileNotFoundError: no folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"run folder {run_dir} is in use by another run (PID {owner}): wait for it to end or stop it, "
            "or choose another trainer.run_name"
        ) from None
    except OSError as err:  # e.g. ENOLCK: a file system without locks
        os.close(fd)
        raise ValueError(
            f"cannot lock run folder {run_dir} ({err}): put trainer.output_dir on a local file system"
        ) from None
    try:
        with naming(run_dir / LOCK_FILE):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:  # e.g. ENOSPC: the caller removes a folder it made
        os.close(fd)
        raise
    return fd


def _create_and_lock(run_dir: Path, attempts: int = 5) -> tuple[int, bool]:
    """Make the run folder if it is missing and lock it; returns (lock fd, whether this call made it).

    A start that fails removes the folder it made, and it can do so after another start found the
    folder and opened its lock file: that start would then lock a file no longer in any folder and
    run in a folder that is gone. So after locking, the file locked must still be the one at
    RUN/.lock; when it is not (or the folder vanished before the open), start over.
    """
    for _ in range(attempts):
        try:
            run_dir.mkdir(parents=True)
            created = True
        except FileExistsError:  # it existed, or another start made it a moment ago: the lock decides
            created = False
        try:
            fd = _lock(run_dir)
        except FileNotFoundError:  # removed between the mkdir and the open
            continue
        except BaseException:  # a full disk, a refused lock: leave no half-made folder behind
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        try:
            current = os.stat(run_dir / LOCK_FILE)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd, created
        os.close(fd)
    raise ValueError(
        f"run folder {run_dir} kept being removed while this start tried to lock it (another start on the "
        "same trainer.run_name failing repeatedly?): check the other process, or choose another trainer.run_name"
    )


@dataclass
class RunFolder:
    """A run's directory while this process owns it: locked, and its checkpoint to resume from."""

    path: Path
    name: str
    checkpoint: Path | None
    created: bool  # this start made the directory (a failure before the run has a record removes it)
    # Whether the run has recorded anything of its own (`job` asks its logger: a step was logged),
    # so that a failure must keep the folder; until it is told, whether config.yaml was written.
    recorded: Callable[[], bool]


def _point_latest_back(run_dir: Path, previous: str | None) -> None:
    """After a failed new run's folder is removed: trainer.output_dir/latest, if it still names it,
    names the run it named before (`previous`), or goes."""
    link = run_dir.parent / "latest"
    if not link.is_symlink() or os.readlink(link) != run_dir.name:
        return  # not made by this start, or another start has moved it on since
    if previous is None:
        link.unlink()
        return
    staging = run_dir.parent / f".latest.{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(previous, staging)
    os.replace(staging, link)


@contextmanager
def run_folder(cfg: Config, source: str | None) -> Iterator[RunFolder]:
    """Own trainer.output_dir/run_name: create the directory if new, lock it, check the resume
    checkpoint against the config; release on exit.

    Nothing of an existing run is changed here: its config.yaml is rewritten only once the run has
    started (`run_loop`). When a new run fails before its first record (`RunFolder.recorded`: a
    reward that raises in step 1, say), the directory this call created is removed again and
    trainer.output_dir/latest named what it named before, so a failed start leaves nothing behind."""
    run_name = cfg.trainer.run_name or f"{resolve_source(source).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.trainer.output_dir) / run_name
    latest = run_dir.parent / "latest"
    previous_latest = os.readlink(latest) if latest.is_symlink() else None
    checkpoint, folder = None, None
    if not run_dir.exists():
        checkpoint = _check_resume_target(cfg, run_dir)  # an explicit trainer.resume path
    fd, created = None, False
    try:
        fd, created = _create_and_lock(run_dir)
        if not created:
            checkpoint = _check_resume_target(cfg, run_dir)
        from diffrl.telemetry.console import console_log, run_started

        folder = RunFolder(run_dir, run_name, checkpoint, created, lambda: (run_dir / CONFIG_FILE).exists())
        with console_log(run_dir):  # RUN/console.log, once the run has started (run_loop)
            run_started(run_dir, checkpoint)  # the run's first line: where to look
            yield folder
    except BaseException:
        if created and fd is not None and not (folder is not None and folder.recorded()):
            shutil.rmtree(run_dir, ignore_errors=True)
            _point_latest_back(run_dir, previous_latest)
            if folder is not None:  # it was announced ("run directory: ..."): say where it went
                print(f"removed {run_dir}: the run failed before it recorded a step", flush=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def link_latest(run_dir: Path) -> None:
    """trainer.output_dir/latest -> the run started last (a relative symlink, swapped atomically),
    so `diffrl eval runs/latest` and the README's commands work as printed."""
    link = run_dir.parent / "latest"
    if link.exists() and not link.is_symlink():
        print(f"note: {link} is not a link (a run named 'latest'?), so it is left as it is")
        return
    staging = run_dir.parent / f".latest.{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(run_dir.name, staging)
    os.replace(staging, link)


def _check_resume_target(cfg: Config, run_dir: Path) -> Path | None:
    checkpoint = find_checkpoint(cfg, run_dir)
    if checkpoint is None and cfg.trainer.resume == "off" and latest_checkpoint(run_dir / "checkpoints"):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=off: choose another trainer.run_name, "
            "or trainer.resume=auto to continue it"
        )
    if checkpoint is None and (run_dir / CONFIG_FILE).is_file():
        # A start from step 0 would rewrite the run's records (metrics.jsonl, configs/step_00000000.yaml):
        # the earlier start's settings and curves are all that is left of it.
        raise ConfigError(
            f"{run_dir} holds an earlier start of this run ({CONFIG_FILE}, its metrics and config history) "
            f"but no checkpoint to resume from (trainer.resume={cfg.trainer.resume}): starting it over would "
            "overwrite those records. Choose another trainer.run_name for a new run, resume a copy of a "
            "checkpoint with trainer.resume=PATH, or move the folder away yourself to reuse its name"
        )
    if checkpoint is not None:
        check_checkpoint(cfg, checkpoint, verified=cfg.trainer.resume == "auto")
        _check_not_past_total(cfg, checkpoint)
    return checkpoint


def _check_not_past_total(cfg: Config, checkpoint: Path) -> None:
    """A checkpoint saved after `trainer.total_steps` would resume into a run with nothing left to
    train and export that later step's weights as if they were the requested step's: refuse it,
    naming the kept checkpoint that does match when there is one."""
    step = json.loads((checkpoint / "meta.json").read_text())["step"]
    total = cfg.trainer.total_steps
    if step <= total:
        return
    earlier = [path for kept, path in complete_checkpoints(checkpoint.parent) if kept <= total]
    fix = (
        f"resume the newest checkpoint at or before step {total}: trainer.resume={earlier[-1]}"
        if earlier
        else f"start a new run (another trainer.run_name): no kept checkpoint is at or before step {total}"
    )
    raise ConfigError(
        f"trainer.total_steps={total} is below step {step} of the checkpoint this run would resume "
        f"({checkpoint}): it would train nothing and end with step {step}'s weights. Raise "
        f"trainer.total_steps, or {fix}"
    )


def prepare_run(cfg: Config, source: str | None) -> tuple[Path, str, Path | None]:
    """The run directory, its name, and the checkpoint to resume from (None for a fresh run),
    without holding the folder (tests and tools); `diffrl train` uses `run_folder`."""
    with run_folder(cfg, source) as folder:
        return folder.path, folder.name, folder.checkpoint


@dataclass
class Job:
    """A started run: its directory, the checkpoint it resumes from, workers, rewards and logger."""

    run_dir: Path
    checkpoint: Path | None
    workers: Any  # a WorkerGroup, or the Placement of an RL job
    rewards: Any
    logger: Any
    plan: RunPlan


@contextmanager
def job(cfg: Config, source: str | None, *, rl: bool = False, plan: RunPlan | None = None) -> Iterator[Job]:
    """Own the run directory (`run_folder`), print the run plan (`plan`, resolved here when not
    given: `rl` a training job, else a supervised one), start the workers (`rl`: the configured
    placement) and the loggers; stop them on exit."""
    from diffrl.telemetry import RunLogger

    plan = plan or run_plan(cfg, "train" if rl else "sft")
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    with ExitStack() as stack:
        folder = stack.enter_context(run_folder(cfg, source))
        print("\n".join(plan.lines()), flush=True)  # after the run's first line, before workers start
        session = placement_session(cfg, plan) if rl else worker_session(cfg, plan)
        workers, rewards = stack.enter_context(session)
        logger = stack.enter_context(
            RunLogger(
                folder.path,
                cfg.trainer.loggers,
                total_steps=cfg.trainer.total_steps,
                config=config_dict,
                run_name=folder.name,
            )
        )
        folder.recorded = lambda: logger.last_step is not None  # a failure keeps a run that logged a step
        yield Job(folder.path, folder.checkpoint, workers, rewards, logger, plan)


def run_loop(loop: TrainingLoop, checkpoint: Path | None, plan: RunPlan | None = None) -> dict[str, Any]:
    """Resume `loop` from `checkpoint` (if any), record the config and the plan (the run has
    started: RUN/config.yaml, RUN/plan.json), run it, and return its summary."""
    if checkpoint is not None:
        loop.resume(checkpoint)
    record_config(loop.run_dir, to_yaml(loop.cfg), loop.step)  # config.yaml, and configs/ keeps each start's
    if plan is not None:
        write_json(loop.run_dir / PLAN_FILE, plan.to_dict())
    from diffrl.telemetry.console import begin_console_log

    begin_console_log()  # what was printed so far, and from now on everything, to RUN/console.log
    link_latest(loop.run_dir)
    return loop.summary(loop.fit())


def train(source: str | None, overrides: Sequence[str] = ()) -> Path:
    """Run a training job; returns its run directory."""
    cfg = load_config(source, overrides)
    from diffrl.telemetry.report import skip_if_finished

    if (finished := skip_if_finished(cfg.trainer)) is not None:
        return finished  # before any model loads: nothing to do
    train_records, val_records = preflight(cfg)
    plan = run_plan(cfg)
    checked = None
    if cfg.trainer.check_at_start:
        from diffrl.controller.check import check_at_start

        checked = check_at_start(cfg, train_records, val_records, plan=plan)
    with job(cfg, source, rl=True, plan=plan) as j:
        if checked is not None:  # after the run's first line, which says where to look
            print(checked, flush=True)
        loop_args = dict(
            placement=j.workers,
            rewards=j.rewards,
            train_records=train_records,
            val_records=val_records,
            logger=j.logger,
        )
        if cfg.algorithm.trainer_type == DIRECT_PREFERENCE:
            from diffrl.controller.direct_preference import DirectPreferenceTrainer

            trainer: TrainingLoop = DirectPreferenceTrainer(cfg, j.run_dir, **loop_args)
        else:
            trainer = PolicyGradientTrainer(
                cfg, j.run_dir, reuse_rollout_log_probs=plan.reuses_rollout_log_probs, plan=plan, **loop_args
            )
        write_json(j.run_dir / "summary.json", run_loop(trainer, j.checkpoint, plan))
        export_final_weights(j.workers.trainer, j.run_dir, cfg)
        if cfg.trainer.keep_best and (best := best_checkpoint(j.run_dir / "checkpoints")) is not None:
            export_final_weights(j.workers.trainer, j.run_dir, cfg, checkpoint=best)  # RUN/export_best
        print_report(j)
    if trainer.stopped is not None:  # after the exports and the report: the run ended cleanly
        raise HealthStop(trainer.stopped)
    return j.run_dir


def print_report(j: Job) -> None:
    """The end-of-run result, once: the logger's closing line (steps, time, train reward, where),
    then the report (validation before -> after, pictures); both go to RUN/console.log."""
    from diffrl.telemetry.report import write_report

    j.logger.close()
    print(write_report(j.run_dir))
