"""Validation shared by every loop (`diffrl train`, `diffrl sft`, `diffrl eval`).

ODE samples of the validation prompts with the fixed validation seed, scored by the configured
rewards: overall reward metrics, the reward mean and every scalar reward extra (the shapes
verifier's `accuracy`, an OCR distance, ...) per data source, `val/accuracy` (the mean over data
sources of their accuracy, when the rewards report one), their standard errors
(`val/rewards/mean_se`, `val/accuracy_se`: `standard_errors`), and an image grid. The same seeds at
every call, so the grids of two validations of a run show the same prompts from the same noise.
Videos: the grid shows each sample's first frame, and every sample is also written as a GIF under
`validation/step_XXXXXX/` with an `index.html` that plays them (docs/video.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffrl.config.schema import Config
from diffrl.controller.sharding import prompt_shard
from diffrl.data import PromptRecord
from diffrl.telemetry import save_png
from diffrl.telemetry.console import progress
from diffrl.telemetry.report import add_accuracy
from diffrl.telemetry.validation_samples import validation_grid, validation_samples, validation_videos
from diffrl.transition import Rollout, concat_rollouts
from diffrl.workers.group import WorkerGroup
from diffrl.workers.reward_workers import gather as gather_rewards


def run_validation(
    cfg: Config,
    workers: WorkerGroup,
    rewards: Any,
    records: Sequence[PromptRecord],
    out_dir: Path,
    step: int,
    logger: Any = None,
) -> dict[str, float]:
    """Validate on `records`; writes `out_dir/validation/step_XXXXXX.png` and `.jsonl` (and, for
    videos, `step_XXXXXX/*.gif` with `index.html`); returns `val/...` metrics."""
    world, n = workers.size, cfg.rollout.val.n
    # Every worker must run the same number of forwards (FSDP gathers weights collectively), so
    # the prompt list is padded to a multiple of the workers by repeating it; the padding is
    # dropped from the result.
    per_worker = math.ceil(len(records) / world)
    padded = [records[i % len(records)] for i in range(per_worker * world)]
    negative = cfg.rollout.pipeline.negative_prompt
    # Rounds of one sampler micro-batch per worker, so the console can say how far validation is;
    # a sample's noise depends on its index only, so the rounds sample what one call would.
    chunk = max(1, cfg.rollout.micro_batch_size // n)
    by_rank: list[list[Rollout]] = [[] for _ in range(world)]
    with progress(f"validation at step {step}", total=len(records), unit="prompts") as shown:
        for start in range(0, per_worker, chunk):
            stop = min(start + chunk, per_worker)
            payloads = [
                prompt_shard(
                    padded[rank * per_worker + start : rank * per_worker + stop],
                    [f"val:{i}" for i in range(rank * per_worker + start, rank * per_worker + stop)],
                    (rank * per_worker + start) * n,
                    negative,
                )
                for rank in range(world)
            ]
            for rank, part in enumerate(workers.scatter("validate_and_score", payloads, rewards=rewards)):
                by_rank[rank].append(part)
            shown.update(min(len(records), stop * world))
        rollout = concat_rollouts([part for parts in by_rank for part in parts])
        handles = rollout.extras.pop("reward_handles")
        keep = len(records) * n
        rollout = rollout.select(slice(0, keep))
        scores = gather_rewards(handles, cfg.trainer.worker_timeout_s).select(slice(0, keep))
    metrics = {f"val/{key}": value for key, value in scores.metrics(rollout.sample_uids()).items()}
    sources = [m.get("data_source", "default") for m in rollout.sample_metadata()]
    scalar_extras = {key: value for key, value in scores.extras.items() if value.ndim == 1}
    for source in sorted(set(sources)):
        mask = torch.tensor([s == source for s in sources])
        metrics[f"val/{source}/reward_mean"] = float(scores.total_B[mask].mean())
        for key, value in scalar_extras.items():
            metrics[f"val/{source}/{key.rsplit('/', 1)[-1]}"] = float(value[mask].float().nanmean())
    add_accuracy(metrics)
    accuracy_B = next(
        (value for key, value in reversed(scalar_extras.items()) if key.rsplit("/", 1)[-1] == "accuracy"),
        None,
    )
    metrics.update(standard_errors(scores.total_B, sources, accuracy_B))
    pixels = rollout.samples.pixels
    rows = validation_samples(rollout.sample_prompts(), sources, scores.total_B, scalar_extras)
    folder = Path(out_dir) / "validation"
    videos = []
    if pixels.ndim == 5:  # [B, T, 3, H, W]: the grid shows first frames, the GIFs the motion
        videos = validation_videos(pixels, rows, folder / f"step_{step:06d}")
    grid = validation_grid(
        pixels, rows, folder / f"step_{step:06d}.jsonl", condition_pixels(records, n, pixels)
    )
    save_png(folder / f"step_{step:06d}.png", grid)
    if logger is not None:
        logger.log_images(step, "val/samples", grid)
        if videos:
            captions = [f"{row['prompt']} (reward {row['reward']:.3f})" for row in rows]
            logger.log_videos(step, "val/videos", list(zip(videos, captions, strict=True)))
    return metrics


def standard_errors(
    total_B: torch.Tensor, sources: Sequence[str], accuracy_B: torch.Tensor | None
) -> dict[str, float]:
    """The standard errors of `val/rewards/mean` and `val/accuracy`, with the sample as the unit:
    `val/rewards/mean_se` = std(rewards, ddof=1) / sqrt(B), and `val/accuracy_se` = sqrt(sum over
    data sources of var_c / n_c) / C, the error of the mean over C sources of each source's mean
    verdict (its NaN verdicts left out, as in `val/<source>/accuracy`). A metric is left out when a
    sample count is below 2 (no variance to estimate).

    The samples of one prompt are correlated, so this understates one validation's error; but every
    validation of a run samples the same prompts from the same noise, so the difference between two
    of them varies less than two independent ones would: used unpaired (the run-health watchdog,
    `diffrl.telemetry.health`), it is a conservative yardstick for a change between validations."""
    out = {}
    total64_B = total_B.detach().double().cpu()
    if total64_B.numel() >= 2:
        out["val/rewards/mean_se"] = float(total64_B.std() / math.sqrt(total64_B.numel()))
    if accuracy_B is not None:
        accuracy64_B = accuracy_B.detach().double().cpu()
        variances = []
        for source in sorted(set(sources)):
            verdicts = accuracy64_B[torch.tensor([s == source for s in sources])]
            verdicts = verdicts[~verdicts.isnan()]
            if verdicts.numel() < 2:
                return out
            variances.append(float(verdicts.var()) / verdicts.numel())
        out["val/accuracy_se"] = math.sqrt(sum(variances)) / len(variances)
    return out


def condition_pixels(records: Sequence[PromptRecord], n: int, pixels: torch.Tensor) -> torch.Tensor | None:
    """uint8 [B, 3, H, W]: each sample's first condition image (its record's, samples `n` per record
    in order) at the samples' size, for the grid; None without condition images or for videos."""
    if not records or not records[0].images or pixels.ndim != 4:
        return None
    import numpy as np
    from PIL import Image

    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    loaded = {}
    for record in records:
        image = record.images[0]
        if image.key not in loaded:
            picture = image.load()
            if picture.size != (width, height):
                picture = picture.resize((width, height), Image.Resampling.BICUBIC)
            loaded[image.key] = torch.from_numpy(np.array(picture)).permute(2, 0, 1)
    return torch.stack([loaded[r.images[0].key] for r in records for _ in range(n)])


__all__ = ["condition_pixels", "run_validation", "standard_errors"]
