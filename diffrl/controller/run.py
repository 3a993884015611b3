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
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import OmegaConf

from diffrl.algos import DIRECT_PREFERENCE
from diffrl.algos.spec import worker_options
from diffrl.config import load_config, to_yaml
from diffrl.config.history import record_config
from diffrl.config.plan import PLAN_FILE, RunPlan
from diffrl.config.registries import DISTILLATION
from diffrl.config.schema import Config
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.placement import Colocated, Placement, Separate
from diffrl.controller.policy_gradient import PolicyGradientTrainer
from diffrl.controller.preflight import preflight, run_plan
from diffrl.controller.restarts import run_with_restarts

# The run folder (diffrl.controller.run_folder); its names are re-exported here for callers of run.
from diffrl.controller.run_folder import (
    LOCK_FILE,
    RunFolder,
    check_checkpoint,
    find_checkpoint,
    link_latest,
    prepare_run,
    run_folder,
)
from diffrl.files import write_json
from diffrl.telemetry.health import HealthStop
from diffrl.train.best_checkpoint import best_checkpoint
from diffrl.train.export_run import export_final_weights
from diffrl.workers.group import WorkerGroup


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


T = TypeVar("T")


@dataclass
class Job:
    """A started run: its directory, the checkpoint it resumes from, workers, rewards and logger."""

    run_dir: Path
    checkpoint: Path | None
    workers: Any  # a WorkerGroup, or the Placement of an RL job
    rewards: Any
    logger: Any
    plan: RunPlan


def run_job(
    cfg: Config,
    source: str | None,
    body: Callable[[Job, dict[str, Any]], T],
    *,
    rl: bool = False,
    plan: RunPlan | None = None,
    before_start: Callable[[], None] | None = None,
) -> T:
    """Own the run directory (`run_folder`: it also checks the resume checkpoint against the
    config), print the run plan (`plan`, resolved here when not given: `rl` a training job, else a
    supervised one), call `before_start` (the start-up check: after every cheap refusal, before
    the workers), start the workers (`rl`: the configured placement) and the loggers, and return
    `body(job, state)`; stop them on exit. After a worker
    death, with trainer.max_restarts, the workers start again and `body` runs again on the newest
    complete checkpoint (`restarts.run_with_restarts`: `state["restarted"]` says so, and `body`
    puts its loop in `state["loop"]`, whose step names the failed one)."""
    plan = plan or run_plan(cfg, "train" if rl else "sft")
    with run_folder(cfg, source) as folder:
        print("\n".join(plan.lines()), flush=True)  # after the run's first line, before workers start
        if before_start is not None:
            before_start()

        def once(checkpoint: Path | None, state: dict[str, Any]) -> T:
            with attempt(cfg, folder, checkpoint, rl=rl, plan=plan, restarted=state["restarted"]) as j:
                return body(j, state)

        return run_with_restarts(cfg, folder.path, folder.checkpoint, once)


@contextmanager
def attempt(
    cfg: Config,
    folder: RunFolder,
    checkpoint: Path | None,
    *,
    rl: bool,
    plan: RunPlan,
    restarted: bool = False,
) -> Iterator[Job]:
    """One start of the workers and the loggers in a run folder this process holds, resuming
    `checkpoint`; stops them on exit. A run restarted after a worker death (trainer.max_restarts,
    diffrl.controller.restarts) has one attempt per start in the same folder (`restarted`: not
    the first, so what the earlier ones logged also keeps the folder on a failure)."""
    from diffrl.telemetry import RunLogger

    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    earlier = folder.recorded if restarted else (lambda: False)
    with ExitStack() as stack:
        session = placement_session(cfg, plan) if rl else worker_session(cfg, plan)
        workers, rewards = stack.enter_context(session)
        logger = stack.enter_context(
            RunLogger(
                folder.path,
                cfg.trainer.loggers,
                total_steps=cfg.trainer.total_steps,
                config=config_dict,
                run_name=folder.name,
                wandb_project=cfg.trainer.project_name,
            )
        )
        # a failure keeps a run that logged a step (in this attempt or an earlier one)
        folder.recorded = lambda: logger.last_step is not None or earlier()
        yield Job(folder.path, checkpoint, workers, rewards, logger, plan)


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
    """Run a training job; returns its run directory. A distillation job
    (algorithm.trainer_type=distillation) runs its own loop and worker
    (`diffrl.controller.distillation.distill`)."""
    cfg = load_config(source, overrides)
    if cfg.algorithm.trainer_type == DISTILLATION:
        from diffrl.controller.distillation import distill

        return distill(source, overrides)
    from diffrl.telemetry.report import skip_if_finished

    if (finished := skip_if_finished(cfg.trainer)) is not None:
        return finished  # before any model loads: nothing to do
    train_records, val_records = preflight(cfg)
    plan = run_plan(cfg)

    def check() -> None:
        """`diffrl check --quick` (trainer.check_at_start): after the run folder and its resume
        checkpoint passed (a resume with other LoRA settings is refused from small files, before
        this check loads the model), before the workers start."""
        from diffrl.controller.check import check_at_start

        if (line := check_at_start(cfg, train_records, val_records, plan=plan)) is not None:
            print(line, flush=True)

    def body(j: Job, state: dict[str, Any]) -> tuple[Job, TrainingLoop]:
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
        state["loop"] = trainer
        write_json(j.run_dir / "summary.json", run_loop(trainer, j.checkpoint, plan))
        export_final_weights(j.workers.trainer, j.run_dir, cfg)
        if cfg.trainer.keep_best and (best := best_checkpoint(j.run_dir / "checkpoints")) is not None:
            export_final_weights(j.workers.trainer, j.run_dir, cfg, checkpoint=best)  # RUN/export_best
        print_report(j)
        return j, trainer

    j, trainer = run_job(
        cfg, source, body, rl=True, plan=plan, before_start=check if cfg.trainer.check_at_start else None
    )
    if trainer.stopped is not None:  # after the exports and the report: the run ended cleanly
        raise HealthStop(trainer.stopped)
    return j.run_dir


def print_report(j: Job) -> None:
    """The end-of-run result, once: the logger's closing line (steps, time, train reward, where),
    then the report (validation before -> after, pictures); both go to RUN/console.log."""
    from diffrl.telemetry.report import write_report

    j.logger.close()
    print(write_report(j.run_dir))


__all__ = [
    "LOCK_FILE",
    "Job",
    "RunFolder",
    "check_checkpoint",
    "find_checkpoint",
    "link_latest",
    "placement_session",
    "prepare_run",
    "print_report",
    "run_folder",
    "run_job",
    "run_loop",
    "train",
    "worker_session",
]
