"""`diffrl train`: check everything cheap first, then start workers and run the loop.

Order matters for users: a config typo, a missing model directory, an empty prompt file or an
unknown reward is reported before Ray or any model starts, and nothing is written for a run that
cannot start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from diffrl.config import load_config, to_yaml
from diffrl.config.loader import resolve_source
from diffrl.config.schema import Config, ConfigError
from diffrl.data import PromptRecord, load_prompts
from diffrl.models import read_model_index
from diffrl.rewards import reward_specs
from diffrl.train.checkpoint import latest_checkpoint, verify_checkpoint
from diffrl.trainer.loop import TrainingLoop
from diffrl.trainer.policy_gradient import VALIDATION_PROMPTS_FROM_TRAIN, PolicyGradientTrainer
from diffrl.trainer.sharding import write_json
from diffrl.workers.group import WorkerGroup

BUILTIN_DATA = Path(__file__).resolve().parents[1] / "config" / "presets" / "data"


def data_path(path: str) -> str:
    """`builtin:<file>` names a prompt file shipped with diffrl (diffrl/config/presets/data/)."""
    if path.startswith("builtin:"):
        return str(BUILTIN_DATA / path.removeprefix("builtin:"))
    return path


def needs_rewards(cfg: Config) -> bool:
    """Offline DPO learns from the dataset's preferences: rewards are optional (validation only)."""
    return not (cfg.algorithm.sample_source == "offline" and not cfg.reward.functions)


def preflight_common(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The checks every job needs before any model or Ray starts: loggers, model directory,
    rewards, data files; returns the train and validation prompts (no validation without rewards)."""
    from diffrl.telemetry import check_loggers

    check_loggers(cfg.trainer.loggers)
    read_model_index(cfg.model.path)
    if needs_rewards(cfg):
        reward_specs(cfg.reward.functions)
    if not cfg.data.train_files:
        raise ConfigError(
            "data.train_files is empty: give at least one prompt file (.txt, .jsonl or .parquet)"
        )
    train = load_prompts([data_path(p) for p in cfg.data.train_files], cfg.data.prompt_key)
    if not cfg.reward.functions:
        val = []  # nothing to score validation samples with
    elif cfg.data.val_files:
        val = load_prompts([data_path(p) for p in cfg.data.val_files], cfg.data.prompt_key)
    else:
        val = train[:VALIDATION_PROMPTS_FROM_TRAIN]
    return train, val


def preflight(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Every check of an RL job that needs no model and no Ray; returns the train and validation prompts."""
    _check_trainer_type(cfg)
    _reject_planned_keys(cfg)
    if cfg.algorithm.trainer_type == "direct_preference":
        _check_direct_preference(cfg)
    train, val = preflight_common(cfg)
    if cfg.algorithm.sample_source == "offline":
        from diffrl.data.preference import check_pairs

        pipe = cfg.rollout.pipeline
        check_pairs(train, cfg.data.chosen_key, cfg.data.rejected_key, pipe.height, pipe.width)
    return train, val


def _check_trainer_type(cfg: Config) -> None:
    """The loss and the loop must fit each other, in both directions: a policy-gradient loss needs
    SDE transitions and log-probs, a direct-preference loss clean samples at fresh noise levels."""
    from diffrl.algos import get_loss

    mode, trainer_type = cfg.actor.loss.mode, cfg.algorithm.trainer_type
    needs = getattr(get_loss(mode), "trainer_type", "policy_gradient")
    if needs != trainer_type:
        raise ConfigError(
            f"actor.loss.mode={mode} needs algorithm.trainer_type={needs}, but it is {trainer_type}: set "
            f"algorithm.trainer_type={needs}, or choose a {trainer_type} loss"
        )


def _check_direct_preference(cfg: Config) -> None:
    """Settings of the direct-preference loop that would otherwise be silently ignored or fail late."""
    from diffrl.trainer.direct_preference import needs_old_adapter

    algo, mode = cfg.algorithm, cfg.actor.loss.mode
    if algo.sample_source == "offline":
        if mode != "dpo":
            raise ConfigError(
                f"algorithm.sample_source=offline reads preference pairs, which only actor.loss.mode=dpo "
                f"trains on (got {mode}): set actor.loss.mode=dpo, or algorithm.sample_source=online"
            )
        if cfg.rollout.n != 2:
            raise ConfigError(
                f"rollout.n={cfg.rollout.n}: with algorithm.sample_source=offline each row is a group of "
                "two images (chosen, rejected), so set rollout.n=2 (actor.mini_batch_size counts images)"
            )
    rc, defaults = algo.rollout_correction, Config().algorithm
    if rc != defaults.rollout_correction:
        raise ConfigError(
            "algorithm.rollout_correction has no effect with algorithm.trainer_type=direct_preference "
            "(no SDE log-probs are compared): leave it at its defaults"
        )
    if algo.old_policy != defaults.old_policy and not needs_old_adapter(cfg):
        raise ConfigError(
            f"algorithm.old_policy has no effect with actor.loss.mode={mode} (no `old` adapter): leave it "
            "at its defaults, or use diffusion_nft / awm with actor.loss.awm_ema_kl_coef > 0"
        )
    if needs_old_adapter(cfg) and cfg.model.lora.rank <= 0:
        raise ConfigError(
            f"actor.loss.mode={mode} needs an `old` adapter, which exists only with LoRA: set "
            "model.lora.rank > 0"
        )


def _reject_planned_keys(cfg: Config) -> None:
    """Keys the schema already has but `diffrl train` does not implement yet: a changed value must
    not be silently ignored."""
    defaults = Config()
    planned = {
        "actor.optimizer_offload": (cfg.actor.optimizer_offload, defaults.actor.optimizer_offload),
    }
    for key, (value, default) in planned.items():
        if value != default:
            raise ConfigError(
                f"{key}={value!r} is not implemented by diffrl train yet: leave it at its default ({default!r})"
            )


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
    # A damaged or old-format checkpoint named explicitly is an error, before any worker starts.
    verify_checkpoint(path)
    return path


def reuse_rollout_log_probs(cfg: Config) -> bool:
    """Whether PPO's old log-probs can be the rollout's own (see `algorithm.old_log_probs`).

    The workers are colocated (the sampler is the trained module), so in `auto` the only thing that
    changes the math between sampling and training is compilation: no-grad and training graphs are
    compiled separately and round differently.
    """
    mode = cfg.algorithm.old_log_probs
    return mode == "rollout" or (mode == "auto" and not cfg.model.compile)


def worker_options(cfg: Config) -> dict[str, Any]:
    """What the workers' engines need beyond the config: an `old` adapter (DiffusionNFT, AWM's EMA
    KL) and, for DPO under full fine-tuning, a frozen reference copy (its reference term is not a
    KL coefficient the engine would see)."""
    if cfg.algorithm.trainer_type != "direct_preference":
        return {}
    from diffrl.trainer.direct_preference import needs_old_adapter

    options: dict[str, Any] = {"with_old": needs_old_adapter(cfg)}
    if cfg.actor.loss.mode == "dpo":
        options["with_reference"] = True
    return options


@contextmanager
def worker_session(cfg: Config) -> Iterator[tuple[WorkerGroup, Any]]:
    """Start the workers (Ray when several, or in-process) and the reward workers; stop them all on
    exit, also when starting one of them failed."""
    from diffrl.rewards.workers import create_reward_workers
    from diffrl.workers.group import InProcessGroup, RayGroup, ensure_ray
    from diffrl.workers.roles import HybridWorker

    world = cfg.world_size
    use_ray = world > 1 or cfg.trainer.ray_address is not None
    started_ray, workers, rewards = False, None, None
    roles = worker_options(cfg)
    try:
        if use_ray:
            # Ray's CPU counts are bookkeeping: declare enough for every worker even on a 2-core laptop.
            reward_cpus = cfg.reward.workers * cfg.reward.cpus_per_worker
            started_ray = ensure_ray(
                cfg.trainer.ray_address,
                num_cpus=None if cfg.trainer.ray_address else int(world + reward_cpus + 1),
            )
            gpus = 1.0 if torch.cuda.is_available() else 0.0
            workers = RayGroup(HybridWorker, world, cfg, num_cpus=1.0, num_gpus=gpus, **roles)
        else:
            workers = InProcessGroup(HybridWorker, 1, cfg, synchronous=True, **roles)
        if cfg.reward.functions:  # offline DPO may run without rewards (no validation then)
            rewards = create_reward_workers(cfg.reward, use_ray=use_ray)
        yield workers, rewards
    finally:
        if rewards is not None:
            rewards.close()
        if workers is not None:
            workers.shutdown()
        if started_ray:
            import ray

            ray.shutdown()


def prepare_run(cfg: Config, source: str | None) -> tuple[Path, str, Path | None]:
    """The run directory (created, with the resolved config.yaml), its name, and the checkpoint to
    resume from (None for a fresh run)."""
    run_name = cfg.trainer.run_name or f"{resolve_source(source).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.trainer.output_dir) / run_name
    checkpoint = find_checkpoint(cfg, run_dir)
    if checkpoint is None and cfg.trainer.resume == "off" and latest_checkpoint(run_dir / "checkpoints"):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=off: choose another trainer.run_name, "
            "or trainer.resume=auto to continue it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir, run_name, checkpoint


@dataclass
class Job:
    """A started run: its directory, the checkpoint it resumes from, workers, rewards and logger."""

    run_dir: Path
    checkpoint: Path | None
    workers: WorkerGroup
    rewards: Any
    logger: Any


@contextmanager
def job(cfg: Config, source: str | None) -> Iterator[Job]:
    """Create (or reopen) the run directory, start the workers and the loggers; stop them on exit."""
    from diffrl.telemetry import RunLogger

    run_dir, run_name, checkpoint = prepare_run(cfg, source)
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    with (
        worker_session(cfg) as (workers, rewards),
        RunLogger(
            run_dir,
            cfg.trainer.loggers,
            total_steps=cfg.trainer.total_steps,
            config=config_dict,
            run_name=run_name,
        ) as logger,
    ):
        yield Job(run_dir, checkpoint, workers, rewards, logger)


def run_loop(loop: TrainingLoop, checkpoint: Path | None) -> dict[str, Any]:
    """Resume `loop` from `checkpoint` (if any), run it, and return its summary."""
    if checkpoint is not None:
        loop.resume(checkpoint)
    return loop.summary(loop.fit())


def train(source: str | None, overrides: Sequence[str] = ()) -> Path:
    """Run a training job; returns its run directory."""
    cfg = load_config(source, overrides)
    train_records, val_records = preflight(cfg)
    with job(cfg, source) as j:
        loop_args = dict(
            workers=j.workers,
            rewards=j.rewards,
            train_records=train_records,
            val_records=val_records,
            logger=j.logger,
        )
        if cfg.algorithm.trainer_type == "direct_preference":
            from diffrl.trainer.direct_preference import DirectPreferenceTrainer

            trainer: TrainingLoop = DirectPreferenceTrainer(cfg, j.run_dir, **loop_args)
        else:
            trainer = PolicyGradientTrainer(
                cfg, j.run_dir, reuse_rollout_log_probs=reuse_rollout_log_probs(cfg), **loop_args
            )
        write_json(j.run_dir / "summary.json", run_loop(trainer, j.checkpoint))
    from diffrl.telemetry.report import write_report

    print(write_report(j.run_dir))
    return j.run_dir
