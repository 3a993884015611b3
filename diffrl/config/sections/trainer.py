"""`trainer.*`: the run itself: steps, checkpoints, validation, loggers, workers and placement, async modes."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.config.checks import (
    require,
    require_at_least,
    require_choice,
    require_positive,
    require_ray_resources,
)
from diffrl.config.sections.health import HealthConfig


@dataclass
class TrainerConfig:
    total_steps: int = 300
    save_freq: int = 50  # steps between checkpoints; 0 = only the final one
    test_freq: int = 25  # steps between validations; 0 = never
    val_before_train: bool = True
    output_dir: str = "runs"
    run_name: str | None = None  # null = "<preset>-<timestamp>"; a folder name, no path
    resume: str = "auto"  # auto: newest complete checkpoint of the run; off; or a checkpoint path
    keep_checkpoints: int = 3  # the newest K are kept
    # also keep RUN/checkpoints/best (the best validation's checkpoint) and export it to RUN/export_best
    keep_best: bool = False
    # the validation metric keep_best maximises; auto = val/accuracy when logged, else val/rewards/mean
    best_metric: str = "auto"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str | None = None  # the wandb project; null = $WANDB_PROJECT, else "diffrl"
    n_gpus_per_node: int = 1  # workers per node (CPU workers when there is no GPU)
    nnodes: int = 1
    ray_address: str | None = None  # join this Ray cluster; null = start a local one
    # colocated: every worker samples and trains one module; separate: trainer ranks and rollout
    # replicas (rollout.replicas) in their own processes, weights streamed after each step
    placement: str = "colocated"
    # sync: sample with the newest weights; one_step_off (separate placement): sample batch k+1
    # while the trainer updates on batch k, one version behind; bounded (separate placement): the
    # replicas keep up to max_staleness batches in flight ahead of the trainer (docs/async.md)
    async_mode: str = "sync"
    # bounded: the most weight versions a trained batch may lag the weights the step starts from
    max_staleness: int = 2
    gpus_per_worker: float = (
        1.0  # GPU share of each trainer rank (below 1 with separate placement on one GPU)
    )
    ray_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per trainer rank
    worker_timeout_s: float = 3600.0  # a worker call that runs longer ends the run (it stopped answering)
    seed: int = 42
    check_at_start: bool = True  # `diffrl check --quick` before the run starts (docs/check.md)
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a non-finite loss or gradient
    # after a worker or node death, start the workers again and resume from the newest complete
    # checkpoint (step 0 when none yet) up to this many times; 0 = the run ends, naming the worker
    max_restarts: int = 0
    # steps run under torch.profiler: each worker's trace and a summary in <run>/profile/step_<N>/
    profile_steps: list[int] = field(default_factory=list)
    health: HealthConfig = field(default_factory=HealthConfig)  # the run-health watchdog

    LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
    PLACEMENTS = ("colocated", "separate")
    ASYNC_MODES = ("sync", "one_step_off", "bounded")
    DEFAULT_MAX_STALENESS = 2

    def __post_init__(self) -> None:
        # YAML 1.1 reads a bare `off` as false (and `on` as true); the key is a string.
        if self.resume in ("False", "false"):
            self.resume = "off"
        elif self.resume in ("True", "true"):
            self.resume = "auto"

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.total_steps", self.total_steps, 1)
        require_at_least(f"{at}.save_freq", self.save_freq, 0)
        require_at_least(f"{at}.test_freq", self.test_freq, 0)
        require(bool(self.resume), f"{at}.resume", self.resume, "must be auto, off, or a checkpoint path")
        require_at_least(f"{at}.keep_checkpoints", self.keep_checkpoints, 1)
        require(
            not self.keep_best or self.test_freq > 0,
            f"{at}.keep_best",
            self.keep_best,
            "needs validations to choose the best checkpoint: set trainer.test_freq > 0, or keep_best=false",
        )
        require(
            self.best_metric == "auto" or self.best_metric.startswith("val/"),
            f"{at}.best_metric",
            self.best_metric,
            "must be auto or a validation metric (val/..., e.g. val/accuracy or val/rewards/mean; higher is better)",
        )
        self.health.validate(f"{at}.health")
        for logger in self.loggers:
            require_choice(f"{at}.loggers", logger, self.LOGGERS)
        require_at_least(f"{at}.n_gpus_per_node", self.n_gpus_per_node, 1)
        require_at_least(f"{at}.nnodes", self.nnodes, 1)
        require_at_least(f"{at}.seed", self.seed, 0)
        require_at_least(f"{at}.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        require_at_least(f"{at}.max_restarts", self.max_restarts, 0)
        for step in self.profile_steps:
            require(
                isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= self.total_steps,
                f"{at}.profile_steps",
                list(self.profile_steps),
                f"lists steps to profile, each an integer from 1 to trainer.total_steps ({self.total_steps}); "
                "e.g. trainer.profile_steps=[3] (after the first step's torch.compile warm-up)",
            )
        require_choice(f"{at}.placement", self.placement, self.PLACEMENTS)
        require_choice(f"{at}.async_mode", self.async_mode, self.ASYNC_MODES)
        require(
            self.async_mode == "sync" or self.placement == "separate",
            f"{at}.async_mode",
            self.async_mode,
            "needs trainer.placement=separate: colocated workers cannot sample while they train",
        )
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 1,
            f"{at}.max_staleness",
            self.max_staleness,
            "must be an integer >= 1 (the weight versions a trained batch may lag; 1 is one step off): "
            "set trainer.max_staleness=1 or more, or trainer.async_mode=sync for on-policy batches",
        )
        require(
            self.max_staleness == self.DEFAULT_MAX_STALENESS or self.async_mode == "bounded",
            f"{at}.max_staleness",
            self.max_staleness,
            f"only applies to trainer.async_mode=bounded (this run's is {self.async_mode}; one_step_off "
            f"is a staleness of 1): set trainer.async_mode=bounded, or leave it at {self.DEFAULT_MAX_STALENESS}",
        )
        require(self.gpus_per_worker > 0, f"{at}.gpus_per_worker", self.gpus_per_worker, "must be > 0")
        require(
            self.gpus_per_worker == 1.0 or self.placement == "separate",
            f"{at}.gpus_per_worker",
            self.gpus_per_worker,
            "only applies to trainer.placement=separate (a colocated worker owns its GPU): leave it at 1",
        )
        require_ray_resources(f"{at}.ray_resources", self.ray_resources)
        require_positive(f"{at}.worker_timeout_s", self.worker_timeout_s)
        if self.run_name is not None:
            # The run folder is output_dir/run_name: a separator or '..' would write elsewhere.
            require(
                bool(self.run_name)
                and self.run_name not in (".", "..")
                and not any(sep in self.run_name for sep in ("/", "\\", "\0")),
                f"{at}.run_name",
                self.run_name,
                "must be a plain folder name (no '/', '\\', '.' or '..'); it is created inside "
                "trainer.output_dir, so put a different parent folder in trainer.output_dir",
            )
