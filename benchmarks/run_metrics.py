"""Summarise a finished `diffrl train` run from its metrics.jsonl: the numbers the end-to-end
benchmarks print (`e2e_recipe.py`, `family_presets.py`).

The first `warmup` steps (compilation, allocator growth) are excluded and the rest averaged. A
"sample" is whatever one trajectory decodes to (an image, or a video for Wan): the trainer's
`timing_per_image_s/*` and `throughput/images_per_s_per_gpu` count trajectories.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def summarise_run(run_dir: Path, warmup: int, measured_steps: int | None = None) -> dict:
    """Throughput, per-phase seconds per sample, MFU per phase, peak memory and compile time.

    measured_steps: average only this many steps after the warm-up (None: all the rest), e.g. to
    leave out a last step run under the profiler, whose overhead would count."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "timing_s/step" in r]
    measured = records[warmup:] if measured_steps is None else records[warmup : warmup + measured_steps]
    if not measured:
        raise ValueError(
            f"no measured steps: the run logged {len(records)} step(s) and {warmup} are warm-up; "
            "run more steps than warm-up steps"
        )

    def mean(key: str) -> float | None:
        values = [r[key] for r in measured if key in r]
        return statistics.fmean(values) if values else None

    # trajectories per GPU per step (the logged throughput is per GPU)
    images = round(measured[0]["timing_s/step"] * measured[0]["throughput/images_per_s_per_gpu"])
    phases = [k.removeprefix("timing_s/") for k in measured[0] if k.startswith("timing_s/")]
    phases = [p for p in phases if p not in ("step", "checkpoint", "validation")]
    step_s = mean("timing_s/step")
    return {
        "images_per_step_per_gpu": images,
        "images_per_s_per_gpu": images / step_s,
        "step_s": step_s,
        "step_s_each": [round(r["timing_s/step"], 3) for r in records],
        "per_image_s": {p: mean(f"timing_per_image_s/{p}") for p in phases},
        "mfu": {p: mean(f"perf/mfu/{p}") for p in [*phases, "step"] if mean(f"perf/mfu/{p}") is not None},
        "peak_mem_gib": max(
            (r["perf/max_memory_allocated_gb"] for r in measured if "perf/max_memory_allocated_gb" in r),
            default=None,
        ),
        "compile_s": records[0]["timing_s/step"] - statistics.median(r["timing_s/step"] for r in measured),
        "old_log_probs_recomputed": "timing_s/old_log_prob" in measured[0],
        "loss": [r.get("actor/loss") for r in records],
        # a policy-gradient loss is ~0 at ratio 1 (group-normalised advantages): the first step's
        # gradient norm is what compares two layouts of the same batch (sequence parallel vs one GPU)
        "grad_norm": [r.get("actor/grad_norm") for r in records],
        # with one optimizer step per step every ratio is taken before the update: ratio_std and
        # clipfrac then measure how far the old log-probs are from the trainer's own (0 when exact)
        "ratio_std": [r.get("actor/ratio_std") for r in records],
        "clipfrac": [r.get("actor/clipfrac") for r in records],
        # the sampler's log-probs against the trainer's recomputed old ones, per step (logged when
        # the old log-probs are recomputed: model.fp8=sampling, rollout correction, ...); {} otherwise
        "rollout_correction": {
            key: [r.get(f"rollout_correction/{key}") for r in records]
            for key in ("abs_logp_diff_mean", "abs_logp_diff_max", "kl")
            if any(f"rollout_correction/{key}" in r for r in records)
        },
    }


def profile_summary(run_dir: Path, step: int) -> dict:
    """The trainer's rank 0 per-call summary of a step run under `trainer.profile_steps`
    (diffrl.telemetry.profiling): wall, GPU busy share and kernel time by kind for each call."""
    recorded = json.loads((Path(run_dir) / "profile" / f"step_{step}" / "summary.json").read_text())
    return recorded["workers"]["trainer_rank0"]["calls"]
