"""`diffrl check PRESET_OR_YAML [key=value ...]`: prove a setup is consistent before a long run.

It runs, on the user's own model and config and through the run's own code (the worker classes,
the sampler, the engine, the weight sync, the reward path), the properties the test suite proves
on tiny models, and reports each as a row of measured value, tolerance and verdict
(`check_report.CheckReport`):

    sampler = pipeline           the ODE sampler against the family's diffusers pipeline  (check_sampling)
    shift / guidance / resolution / text length   read back from what the transformer received
    log-probs = trainer          per trained step: bitwise where the run reuses them     (check_sampling)
    reward <name>                finite scores, one per sample, a remote one in time     (check_resources)
    memory: <phase>              one micro-batch of each phase at the preset's sizes     (check_resources)
    weights: replicas = trainer  separate placement: digests after a sync, LoRA included (check_resources)

`quick` (`diffrl check --quick`, and what `diffrl train` runs at start unless
`trainer.check_at_start=false`) leaves out the two parts that cost more than seconds: the memory
phases at the preset's full micro-batch sizes and starting the separate placement's pools.

Everything that needs no model (config, model files, data, a remote scorer's /health) is checked
first by the run's own preflight: a bad config is a ValueError (exit 2), never a failed row.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from diffrl.algos import DIRECT_PREFERENCE
from diffrl.config import load_config
from diffrl.config.plan import RunPlan
from diffrl.config.schema import Config
from diffrl.controller.check_report import PASS, CheckReport, CheckRow, skipped
from diffrl.controller.check_resources import memory_rows, reward_rows, weight_sync_rows
from diffrl.controller.check_sampling import log_probs_vs_trainer, sampler_vs_pipeline
from diffrl.data import PromptRecord

#: Prompts the pipeline comparison samples (one sample each), from the validation or train file.
PIPELINE_PROMPTS = 2


def check(source: str | None, overrides: Sequence[str] = (), *, quick: bool = False) -> CheckReport:
    """Load the config (`diffrl config` semantics), run every check, return the report."""
    cfg = load_config(source, overrides)
    from diffrl.controller.preflight import preflight, run_plan

    train_records, val_records = preflight(cfg)
    return check_config(cfg, train_records, val_records, quick=quick, plan=run_plan(cfg))


def check_config(
    cfg: Config,
    train_records: Sequence[PromptRecord],
    val_records: Sequence[PromptRecord],
    *,
    quick: bool,
    plan: RunPlan | None = None,
) -> CheckReport:
    """The checks of a config that passed the run's preflight (`diffrl.controller.preflight.preflight`),
    under its run plan (`plan`; resolved here when not given)."""
    if plan is None:
        from diffrl.controller.preflight import run_plan

        plan = run_plan(cfg)
    start = time.perf_counter()
    records = list(val_records or train_records)[:PIPELINE_PROMPTS] or list(train_records)[:1]
    group = list(train_records)[:1]  # one prompt group of rollout.n samples for the log-probs
    rows: list[CheckRow] = []
    separate = cfg.trainer.placement == "separate"
    rows += _in_process(cfg, records, group, plan, quick=quick, log_probs=not (separate and not quick))
    if not separate:
        rows.append(
            skipped(
                "weights: replicas = trainer",
                "trainer.placement=colocated: sampler and trainer share one module",
            )
        )
    elif quick:
        rows.append(
            skipped(
                "weights: replicas = trainer", "--quick leaves out starting the trainer and replica pools"
            )
        )
    else:
        rows += _separate_pools(cfg, group, plan)
    return CheckReport(rows, time.perf_counter() - start)


def _trains_on_log_probs(cfg: Config) -> bool:
    return cfg.algorithm.trainer_type != DIRECT_PREFERENCE


def _in_process(
    cfg: Config,
    records: list[PromptRecord],
    group: list[PromptRecord],
    plan: RunPlan,
    *,
    quick: bool,
    log_probs: bool,
) -> list[CheckRow]:
    """The checks that run on one worker of the colocated kind in this process: the same
    HybridWorker class a colocated run starts (engine with its LoRA adapters, sampler on its
    module), on this process's device."""
    from diffrl.algos.spec import worker_options
    from diffrl.workers.roles import HybridWorker

    worker = HybridWorker(cfg, **worker_options(cfg))
    try:
        policy = _sampling_policy(cfg, worker)
        rows, ode = sampler_vs_pipeline(
            worker.engine.adapter,
            cfg,
            [r.prompt for r in records],
            policy,
            metadata=[r.metadata for r in records],
            images=_images(records),
        )
        if log_probs:
            rows += _log_prob_rows(
                cfg, group, sample=worker.rollout.sample, recompute=worker.staging.log_probs
            )
        rows += reward_rows(cfg, ode, _images(records))
        if quick:
            rows.append(skipped("memory", "--quick leaves out the micro-batches at the preset's sizes"))
        else:
            rows += memory_rows(
                cfg, worker, [r.prompt for r in group or records], images=_images(group or records), plan=plan
            )
        return rows
    finally:
        del worker
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _images(records: Sequence[PromptRecord]) -> list | None:
    """The records' condition images (image-edit families), None when they carry none."""
    return [r.images for r in records] if any(r.images for r in records) else None


def _sampling_policy(cfg: Config, worker) -> Callable[[], AbstractContextManager]:
    """The context a colocated run samples in: the trained adapter (merged into the weights with
    model.lora.merge_inference), as `HybridWorker` wires its sampler to `inference_policy`."""
    from diffrl.train.engine import POLICY

    return lambda: worker.engine.inference_policy(POLICY)


def _log_prob_rows(cfg: Config, group: list[PromptRecord], *, sample, recompute) -> list[CheckRow]:
    if not _trains_on_log_probs(cfg) or not group:
        return log_probs_vs_trainer(cfg, None, None)
    rollout = sample(
        [r.prompt for r in group],
        seed=cfg.rollout_seed,
        step=0,
        uids=["check"] * len(group),
        metadata=[r.metadata for r in group],
        images=_images(group),
    )
    # A run that reuses the sampled log-probs compares them with its update's first forward (grad
    # on: another graph than no-grad when compiled); one that recomputes, with its own recompute.
    recomputed, _ = recompute(rollout, as_trained=True if cfg.reuses_rollout_log_probs else None)
    steps = rollout.step_indices.tolist()
    return log_probs_vs_trainer(cfg, rollout.samples.log_probs_BW, recomputed, steps)


def _separate_pools(cfg: Config, group: list[PromptRecord], plan: RunPlan) -> list[CheckRow]:
    """The separate placement's own pools (`placement_session`): weight sync, and the log-probs a
    replica sampled against the trainer's recomputation."""
    from diffrl.controller.run import placement_session

    with placement_session(cfg, plan) as (placement, _rewards):
        rows, sampled, recomputed = weight_sync_rows(cfg, placement, group)
    if _trains_on_log_probs(cfg):
        steps = _window_steps(cfg)
        rows += log_probs_vs_trainer(cfg, sampled, recomputed, steps)
    else:
        rows += log_probs_vs_trainer(cfg, None, None)
    return rows


def _window_steps(cfg: Config) -> list[int]:
    """The denoising steps of step 0's SDE window (the sampler's own `window`)."""
    from diffrl.rollout.window import window_start

    lo, hi = cfg.rollout.sde_window_range
    size = cfg.rollout.sde_window_size
    sde = cfg.rollout.sde
    k0 = window_start(
        sde.window_strategy, lo, hi, size, seed=cfg.rollout_seed, step=0, iters_per_group=sde.iters_per_group
    )
    return list(range(k0, k0 + size))


def check_at_start(
    cfg: Config,
    train_records: Sequence[PromptRecord],
    val_records: Sequence[PromptRecord],
    *,
    plan: RunPlan | None = None,
) -> str:
    """`diffrl train`'s quick check (trainer.check_at_start): the line the run prints after its
    run-directory line when every check passes; otherwise the table, and a ValueError (exit 2,
    before the run starts) naming the failed checks.

    It runs on one worker of the colocated kind in this process, on this process's device, so it
    checks a one-worker colocated run as that run will compute. A run over several workers or with
    separate placement holds the model differently (sharded, or on its own replicas) and may not
    fit one device at all: the start-up check says so and leaves it to `diffrl check`, which the
    user runs where the model fits. A setup that passed before (the same model files, settings, diffrl
    source, torch and device: `diffrl.controller.check_cache`) is not checked again."""
    if cfg.world_size > 1 or cfg.trainer.placement != "colocated":
        return (
            f"setup check skipped at start: it runs on one device in this process, and this run "
            f"uses {cfg.world_size} worker(s) with trainer.placement={cfg.trainer.placement}; run "
            "`diffrl check` with this run's arguments before a long run"
        )
    from diffrl.controller import check_cache
    from diffrl.models import resolve_model_path

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    key = check_cache.check_key(cfg, resolve_model_path(cfg.model.path), device)
    if (before := check_cache.passed_before(key)) is not None:
        return (
            f"setup check: skipped, it passed with this model and these settings on {before['at']} "
            f"(diffrl check runs it again; record {check_cache.cache_dir() / key}.json)"
        )
    print(
        "setup check (diffrl check --quick): sampling and re-evaluating a few trajectories on one "
        "worker, before the run starts (trainer.check_at_start=false skips it) ...",
        file=sys.stderr,
        flush=True,
    )
    report = check_config(cfg, train_records, val_records, quick=True, plan=plan)
    if report.failed:
        print(report.table(), end="", flush=True)
        names = ", ".join(r.check for r in report.failed)
        raise ValueError(
            f"the setup check failed ({names}; the table above has each measured value and what to change): "
            "fix the setup, or set trainer.check_at_start=false to start anyway"
        )
    passed = sum(1 for r in report.rows if r.verdict == PASS)
    check_cache.remember_pass(key, passed, report.seconds)
    return (
        f"setup check (diffrl check --quick): {passed} checks passed in {report.seconds:.1f} s "
        "(trainer.check_at_start=false skips it)"
    )
