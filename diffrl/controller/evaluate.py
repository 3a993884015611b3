"""`diffrl eval`: the validation of a run, a checkpoint or a model, on demand.

TARGET is one of:
- a run directory (it holds config.yaml): its newest complete checkpoint, with the run's config;
- a checkpoint directory (RUN/checkpoints/step_N): that checkpoint, with its run's config;
- a model (a diffusers directory, or `toy:shapes` / `tiny:<family>`): the base model, with the
  `default` preset's validation (the shapes world's held-out split).

`key=value` overrides apply on top (e.g. `data.val_files=[my_prompts.jsonl]` or `rollout.val.n=8`).
It prints the headline numbers (`val/rewards/mean`, `val/accuracy` and the shapes verifier's
accuracy per category when that reward is configured) and writes every metric to `eval.json`, with
the image grid, in the output directory.

`with_base` (`diffrl eval RUN --with-base`) first validates the base model the run started from,
in the same worker session and with the same validation (prompts, noise seeds, sampler settings:
the run's own), then the checkpoint. A fresh worker holds the base: a LoRA starts with B = 0 and
a full fine-tuning run from the base weights, exactly as the run's step-0 validation did. So each
tile pair of `base_vs_trained.png` is one prompt from one noise, and the per-category table pairs
the samples: the fair answer to "what did RL change?", where sampling base and LoRA by hand
easily differs in CFG or seeds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from diffrl.config import load_config
from diffrl.config.registries import DISTILLATION
from diffrl.config.schema import Config
from diffrl.controller.preflight import preflight_common
from diffrl.controller.run import worker_session
from diffrl.controller.validation import run_validation
from diffrl.files import check_output_dir
from diffrl.telemetry.plots import side_by_side
from diffrl.telemetry.report import (
    HEADLINE,
    category_table,
    format_table,
    is_source_accuracy,
    validation_metrics,
)
from diffrl.telemetry.validation_samples import read_samples, verdict_label
from diffrl.train.checkpoint import latest_checkpoint, verify_checkpoint


def resolve_target(target: str, overrides: Sequence[str]) -> tuple[Config, Path | None, Path]:
    """(config, checkpoint or None, default output directory) for an eval TARGET."""
    path = Path(target)
    if (path / "config.yaml").is_file():  # a run directory
        checkpoint = latest_checkpoint(path / "checkpoints")
        if checkpoint is None:
            raise FileNotFoundError(
                f"run {path} has no complete checkpoint in {path / 'checkpoints'}: nothing to evaluate yet"
            )
        return (
            load_config(str(path / "config.yaml"), overrides, job="eval"),
            checkpoint,
            path / "eval" / checkpoint.name,
        )
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        verify_checkpoint(path)  # damaged or old-format: a ValueError here, before any worker starts
        run = path.parent.parent
        return load_config(str(run / "config.yaml"), overrides, job="eval"), path, run / "eval" / path.name
    if path.is_dir() and not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{target} is neither a run directory (config.yaml), a checkpoint (RUN/checkpoints/step_N) nor "
            "a diffusers model directory (model_index.json)"
        )
    cfg = load_config("default", [f"model.path={target}", *overrides], job="eval")
    name = (path.name or target).replace(":", "_")  # toy:shapes -> toy_shapes: no colon in a path
    return cfg, None, Path(cfg.trainer.output_dir) / "eval" / name


def evaluate(
    target: str, overrides: Sequence[str] = (), out_dir: str | None = None, *, with_base: bool = False
) -> dict[str, float]:
    """Validate TARGET (see the module docstring); returns the metrics and prints them. With
    `with_base`, the base model's validation first, and both side by side."""
    cfg, checkpoint, default_out = resolve_target(target, overrides)
    if with_base and checkpoint is None:
        raise ValueError(
            f"--with-base compares a run's checkpoint with the base model it started from, but {target} "
            "is a model: give a run directory or RUN/checkpoints/step_N (or drop --with-base)"
        )
    _, val_records = preflight_common(cfg)
    out = check_output_dir(Path(out_dir) if out_dir else default_out, "--out")
    base = None
    with _session(cfg) as (workers, rewards):
        if with_base:  # before the load: the workers hold the base model (module docstring)
            base = validation_metrics(run_validation(cfg, workers, rewards, val_records, out, 0))
        step = 0
        if checkpoint is not None:
            step = int(workers.call("checkpoint.load", str(checkpoint))[0]["step"])
        metrics = validation_metrics(run_validation(cfg, workers, rewards, val_records, out, step))
    out.mkdir(parents=True, exist_ok=True)
    record = {"target": target, "checkpoint": str(checkpoint), "step": step, "metrics": metrics}
    if base is not None:
        record["base"] = base
    (out / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
    headline = [key for key in HEADLINE if key in metrics]
    headline += sorted(key for key in metrics if is_source_accuracy(key))
    width = max(map(len, headline), default=0)
    print(
        f"evaluated {target}"
        + (f" ({checkpoint})" if checkpoint else "")
        + f" on {len(val_records)} prompts:"
        + ("  base model → step " + str(step) if base is not None else "")
    )
    for key in headline:
        before = f"{base.get(key, float('nan')):.4f} → " if base is not None else ""
        print(f"  {key:<{width}}  {before}{metrics[key]:.4f}")
    if base is not None:
        _print_base_comparison(out, step)
    print(f"wrote {out / 'eval.json'} (all {len(metrics)} metrics) and {out / 'validation'}")
    return metrics


def _session(cfg):
    """The workers that load the run's checkpoints: a distillation run's hold its fake-score adapter too."""
    if cfg.algorithm.trainer_type == DISTILLATION:
        from diffrl.controller.distillation import distillation_session
        from diffrl.controller.preflight import run_plan

        return distillation_session(cfg, run_plan(cfg, "eval"))
    return worker_session(cfg)


def _print_base_comparison(out: Path, step: int) -> None:
    """The paired per-category table and the labelled side-by-side grid of base and checkpoint."""
    validation = out / "validation"
    samples = [validation / f"step_{s:06d}.jsonl" for s in (0, step)]
    if all(path.is_file() for path in samples):
        table = category_table(read_samples(samples[0]), read_samples(samples[1]))
        if table:  # verdicts per sample (the shapes verifier): the paired change with its error bar
            for line in format_table(table, 0, step):
                print(line.replace("step 0 →", "base →", 1))
    grids = [validation / f"step_{s:06d}.png" for s in (0, step)]
    if all(path.is_file() for path in grids):
        labels = [verdict_label("base model", samples[0]), verdict_label(f"step {step}", samples[1])]
        side_by_side(grids, labels, out / "base_vs_trained.png")
        print(f"base and trained side by side (same prompts, same noise): {out / 'base_vs_trained.png'}")


__all__ = ["evaluate", "resolve_target"]
