"""The single-controller distillation loop: DMD2 (`algorithm.trainer_type=distillation`).

A few-step student learns to sample what the base model (the teacher, adapters off, with CFG)
samples in many steps; no reward is involved in training. One step reads top to bottom:

    prompts      data.prompts_per_step prompts from the data sampler
    stage        each worker samples rollout.n student inputs per prompt by backward simulation
                 (a random step of the student's rollout.pipeline.num_inference_steps, reached by
                 its own Euler steps from seeded noise) and keeps them (diffrl.train.distillation)
    fake_score   actor.loss.dmd_fake_updates optimizer steps of the fake-score adapter on those
                 samples: flow matching on what the student generates
    student      one optimizer step of the student on the distribution-matching loss
                 (diffrl.algos.dmd2: fake minus teacher prediction on its re-noised samples)
    validation   every `test_freq` steps: the student's ODE samples at rollout.val.num_inference_steps
                 with rollout.pipeline.guidance_scale (1: the student samples without CFG), scored
                 by the configured rewards (for the shapes world, the verifier's held-out accuracy)
    checkpoint   every `save_freq` steps and at the end: both adapters, the student's optimizer, the
                 data position, the RNG states, and (RUN/checkpoints/fake_score/step_N) the fake
                 score's AdamW and update count (diffrl.workers.distillation_worker), so a resumed
                 run logs the metrics the uninterrupted one would; a resume that changes a training
                 setting stops, naming it (`check_resume_changes`).

Single process for now: one colocated worker (trainer.n_gpus_per_node=1, trainer.nnodes=1).
At the end RUN/export holds the student as a LoRA with its sampling settings, as `diffrl train`'s.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from diffrl.algos import DISTILLATION, DistillationSpec, algorithm
from diffrl.config import load_config
from diffrl.config.plan import RunPlan
from diffrl.config.schema import Config, ConfigError
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.preflight import preflight, run_plan
from diffrl.controller.run import Job, print_report, run_folder, run_loop
from diffrl.controller.sharding import prompt_shard
from diffrl.files import write_json
from diffrl.telemetry import peak_over_workers
from diffrl.telemetry.health import HealthStop
from diffrl.train.export_run import export_final_weights
from diffrl.workers.group import InProcessGroup, WorkerGroup


class DistillationTrainer(TrainingLoop):
    """Runs `cfg` (algorithm.trainer_type=distillation) on `workers` (the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, **loop_args: Any):
        super().__init__(cfg, run_dir, **loop_args)
        spec = algorithm(cfg.actor.loss.mode)
        if not isinstance(spec, DistillationSpec):
            raise ValueError(
                f"actor.loss.mode={spec.name!r} is not a distillation algorithm: set actor.loss.mode=dmd2, "
                "or algorithm.trainer_type to the loop of your loss"
            )
        self.spec = spec
        #: fake-score updates made before each student update of this start (two time-scale updates)
        self.fake_updates_per_student: list[int] = []

    def train_step(self) -> dict[str, float]:
        cfg, world = self.cfg, self.workers.size
        self.timer.reset()
        records = [record for _, record in self.sampler.next_batch()]
        per_worker = len(records) // world
        shards = [
            prompt_shard(
                records[rank * per_worker : (rank + 1) * per_worker],
                [f"{self.step}:{i}" for i in range(rank * per_worker, (rank + 1) * per_worker)],
                rank * per_worker * cfg.rollout.n,
                cfg.rollout.pipeline.negative_prompt,
            )
            for rank in range(world)
        ]
        metrics: dict[str, float] = {}
        with self.timer.phase("student_sampling"):
            staged = self.workers.scatter("distill_stage", shards, seed=cfg.trainer.seed, step=self.step)
        metrics.update({f"distill/{key}": value for key, value in staged[0].items()})
        sums: dict[str, float] = defaultdict(float)
        updates = cfg.actor.loss.dmd_fake_updates
        with self.timer.phase("fake_score_update"):
            for update in range(1, updates + 1):
                for key, value in self.workers.call("fake_score_update", update)[0].items():
                    sums[key] += value / updates
        self.fake_updates_per_student.append(updates)
        metrics.update({f"actor/{key}": value for key, value in sums.items()})
        with self.timer.phase("student_update"):
            student = self.workers.call("student_update")[0]
        metrics.update({f"actor/{key}": value for key, value in student.items()})
        metrics["distill/fake_updates"] = float(updates)
        metrics.update(self.timer.metrics(self.images_per_step, world))
        metrics.update(peak_over_workers(self.workers.call("report.memory")))
        metrics["train/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics


# ---------------------------------------------------------------------------------- command
def check_distillation(cfg: Config) -> None:
    """What the distillation loop supports today (before any model loads)."""
    if cfg.algorithm.trainer_type != DISTILLATION:
        raise ValueError(
            f"algorithm.trainer_type={cfg.algorithm.trainer_type}: this is the distillation loop"
        )
    if cfg.world_size != 1 or cfg.trainer.placement != "colocated" or cfg.trainer.ray_address is not None:
        raise ValueError(
            "distillation runs on one colocated worker for now: set trainer.n_gpus_per_node=1, "
            "trainer.nnodes=1, trainer.placement=colocated and trainer.ray_address=null"
        )
    if cfg.trainer.async_mode != "sync":
        raise ValueError(
            f"trainer.async_mode={cfg.trainer.async_mode}: the distillation loop samples its own student "
            "inputs each step; set trainer.async_mode=sync"
        )
    if cfg.model.lora.rank <= 0:
        raise ValueError(
            "distillation keeps the student and the fake score as LoRA adapters of the frozen base (the "
            "teacher): set model.lora.rank > 0"
        )


#: Keys whose change alters what a resumed distillation trains (model, student, fake score, data,
#: seed); anything else (validation, logging, checkpoint cadence, total_steps) may change on resume.
TRAINING_KEYS = ("model.", "actor.", "algorithm.", "rollout.", "data.", "trainer.seed")
#: Within those, what only validation reads, and the switch that lets a resume change the rest.
NOT_TRAINING_KEYS = ("rollout.val.", "data.val_", "actor.loss.dmd_resume_changes")


def training_changes(cfg: Config, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) of each key of `TRAINING_KEYS` that this config changes from the run's
    RUN/config.yaml (`diffrl.config.history.changed_keys`); none for a run without one."""
    from diffrl.config import to_yaml
    from diffrl.config.history import CONFIG_FILE, changed_keys

    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return []
    return [
        change
        for change in changed_keys(saved.read_text(encoding="utf-8"), to_yaml(cfg))
        if change[0].startswith(TRAINING_KEYS) and not change[0].startswith(NOT_TRAINING_KEYS)
    ]


def check_resume_changes(cfg: Config, run_dir: Path, checkpoint: Path | None) -> None:
    """A resume continues the saved run exactly only under its own training settings: one that
    changes any stops here, naming them, unless actor.loss.dmd_resume_changes=true (then the
    changes are printed as a warning when the run starts, as every resume's are)."""
    if checkpoint is None or cfg.actor.loss.dmd_resume_changes:
        return
    changes = training_changes(cfg, run_dir)
    if changes:
        shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)
        raise ConfigError(
            f"resuming {checkpoint} would change {len(changes)} training setting(s) of the run: {shown}. "
            "The resumed steps would not continue the saved run: resume with the run's own settings "
            f"({run_dir / 'config.yaml'}), start a new run (another trainer.run_name), or pass "
            "actor.loss.dmd_resume_changes=true to continue with the changes"
        )


@contextmanager
def distillation_session(cfg: Config, plan: RunPlan) -> Iterator[tuple[WorkerGroup, Any]]:
    """One in-process `DistillationWorker` and the reward workers (for validation); stops both."""
    from diffrl.telemetry.console import progress
    from diffrl.workers.distillation_worker import DistillationWorker
    from diffrl.workers.reward_workers import create_reward_workers
    from diffrl.workers.threads import plan_threads, set_threads, thread_env

    threads = plan_threads(1, 0, ray=False)
    restore = set_threads(threads.driver)
    with ExitStack() as stack:
        stack.callback(restore)
        with progress(f"starting 1 worker and loading {cfg.model.path}"):
            workers = InProcessGroup(DistillationWorker, 1, cfg, synchronous=True, plan=plan)
            stack.callback(workers.shutdown)
            workers.timeout_s = cfg.trainer.worker_timeout_s
        rewards = None
        if cfg.reward.functions:
            rewards = create_reward_workers(cfg.reward, use_ray=False, env_vars=thread_env(threads.reward))
            stack.callback(rewards.close)
        yield workers, rewards


def distill(source: str | None, overrides: Sequence[str] = ()) -> Path:
    """Run a distillation job (`diffrl train` with algorithm.trainer_type=distillation); returns
    its run directory (the student's LoRA in RUN/export)."""
    from diffrl.telemetry import RunLogger
    from diffrl.telemetry.report import skip_if_finished

    cfg = load_config(source, overrides)
    check_distillation(cfg)
    if (finished := skip_if_finished(cfg.trainer)) is not None:
        return finished
    train_records, val_records = preflight(cfg)
    plan = run_plan(cfg)
    with run_folder(cfg, source) as folder:
        check_resume_changes(cfg, folder.path, folder.checkpoint)
        print("\n".join(plan.lines()), flush=True)
        with ExitStack() as stack:
            workers, rewards = stack.enter_context(distillation_session(cfg, plan))
            logger = stack.enter_context(
                RunLogger(
                    folder.path,
                    cfg.trainer.loggers,
                    total_steps=cfg.trainer.total_steps,
                    config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                    run_name=folder.name,
                    wandb_project=cfg.trainer.project_name,
                )
            )
            folder.recorded = lambda: logger.last_step is not None
            trainer = DistillationTrainer(
                cfg,
                folder.path,
                workers=workers,
                rewards=rewards,
                train_records=train_records,
                val_records=val_records,
                logger=logger,
            )
            write_json(folder.path / "summary.json", run_loop(trainer, folder.checkpoint, plan))
            export_final_weights(workers, folder.path, cfg)
            print_report(Job(folder.path, folder.checkpoint, workers, rewards, logger, plan))
    if trainer.stopped is not None:
        raise HealthStop(trainer.stopped)
    return folder.path


__all__ = [
    "NOT_TRAINING_KEYS",
    "TRAINING_KEYS",
    "DistillationTrainer",
    "check_distillation",
    "check_resume_changes",
    "distill",
    "distillation_session",
    "training_changes",
]
