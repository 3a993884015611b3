"""RunLogger: one call per step sends the step's metrics to every enabled sink.

    with RunLogger(run_dir, cfg.trainer.loggers, total_steps=..., config=cfg_dict, run_name=name) as logger:
        logger.log(step, metrics)                      # {"group/stat": float}
        logger.log_images(step, "val/samples", grid)   # uint8 (H, W, 3)
        logger.log_videos(step, "val/videos", [(gif_path, caption), ...])   # files already written

Sinks (`trainer.loggers`): console (a progress line per step with ETA, a summary on close),
jsonl (`run_dir/metrics.jsonl`), tensorboard (`run_dir/tensorboard/`), wandb (optional package,
imported only when asked for). Details and the resume rules are in `diffrl.telemetry.sinks`.
Call it from one thread (the driver).
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffrl.telemetry.sinks import ConsoleSink, JsonlSink, TensorBoardSink, WandbSink

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
RESERVED_KEYS = ("step", "time")

# the package each optional sink needs: (import name, pip name)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_loggers(loggers: Sequence[str]) -> None:
    """Raise before any heavy work if a logger name is unknown or its package is missing."""
    for name in loggers:
        if name not in LOGGERS:
            raise ValueError(f"trainer.loggers: unknown logger {name!r}; choose from {list(LOGGERS)}")
        if name in _PACKAGES:
            module, pip_name = _PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ImportError(
                    f"trainer.loggers includes {name!r} but the {pip_name} package is not installed: "
                    f"pip install {pip_name} (or remove {name} from trainer.loggers)"
                )


def _as_float(key: Any, value: Any) -> float:
    if not isinstance(key, str) or not key:
        raise TypeError(f"metric names must be non-empty strings, got {key!r}")
    if key in RESERVED_KEYS:
        raise ValueError(f"metric name {key!r} is reserved (metrics.jsonl uses it); rename the metric")
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        size = value.numel() if isinstance(value, torch.Tensor) else np.size(value)
        if size != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {tuple(value.shape)}")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a real number, got {type(value).__name__}: {value!r:.80}")
    return float(value)


class RunLogger:
    """Fans `log` / `log_images` out to the sinks named in `loggers`; a context manager (closes them).

    run_dir: the run's directory (created if missing); metrics.jsonl, tensorboard/ and wandb/ go here.
    loggers: names from `LOGGERS` (`trainer.loggers`).
    total_steps: for the console's `step s/total` and ETA.
    config: the resolved config as plain containers (TensorBoard text, wandb config).
    run_name: shown on the console and used as the wandb run name.
    wandb_project: wandb project (trainer.project_name); None = $WANDB_PROJECT or "diffrl".

    The first step this logger writes starts a new history: an earlier attempt's records of steps
    >= it are dropped from metrics.jsonl and hidden in TensorBoard (a run resumed from step k's
    checkpoint first logs step k + 1).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers: Sequence[str],
        *,
        total_steps: int,
        config: Mapping[str, Any],
        run_name: str,
        wandb_project: str | None = None,
    ) -> None:
        for name in loggers:
            if name not in LOGGERS:
                raise ValueError(f"trainer.loggers: unknown logger {name!r}; choose from {list(LOGGERS)}")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.run_name = run_name
        self.last_step: int | None = None
        self.sinks: list[Any] = []
        self._closed = False
        wanted = list(dict.fromkeys(loggers))  # dedupe, keep order
        try:
            # metrics.jsonl first: the durable record is written before anything else can fail
            if "jsonl" in wanted:
                self.sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
            if "tensorboard" in wanted:
                self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard", config))
            if "wandb" in wanted:
                self.sinks.append(
                    WandbSink(self.run_dir, run_name=run_name, config=config, project=wandb_project)
                )
            if "console" in wanted:
                self.sinks.append(
                    ConsoleSink(total_steps=total_steps, run_name=run_name, run_dir=self.run_dir)
                )
        except BaseException:
            self.close(failed=True)
            raise

    @property
    def jsonl_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Send the step's metrics (name -> real number; NaN/inf allowed) to every sink; returns them as floats."""
        step = self._check_open(step)
        clean = {key: _as_float(key, value) for key, value in metrics.items()}
        for sink in self.sinks:
            sink.log(step, clean)
        self.last_step = step
        return clean

    def log_more(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """More metrics of a step whose record was already written (e.g. `timing_s/checkpoint`,
        measured after the step's record had to be durable): a second record of the step in every
        sink but the console, which printed the step's line already. `read_metrics` merges them."""
        step = self._check_open(step)
        clean = {key: _as_float(key, value) for key, value in metrics.items()}
        for sink in self.sinks:
            if not isinstance(sink, ConsoleSink):
                sink.log(step, clean)
        return clean

    def log_images(self, step: int, tag: str, image_HWC: torch.Tensor | np.ndarray) -> None:
        """A uint8 (H, W, 3) image (e.g. `image_grid(...)`) to TensorBoard and wandb under `tag`."""
        step = self._check_open(step)
        if isinstance(image_HWC, torch.Tensor):
            image_HWC = image_HWC.detach().cpu().numpy()
        if (
            not isinstance(image_HWC, np.ndarray)
            or image_HWC.dtype != np.uint8
            or image_HWC.ndim != 3
            or image_HWC.shape[2] not in (1, 3, 4)
        ):
            raise ValueError(
                f"log_images needs a uint8 (H, W, C) image with C in 1/3/4, got "
                f"{getattr(image_HWC, 'dtype', type(image_HWC).__name__)} {getattr(image_HWC, 'shape', '')}"
            )
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"image tag must be a non-empty string, got {tag!r}")
        for sink in self.sinks:
            sink.log_images(step, tag, image_HWC)

    def log_videos(self, step: int, tag: str, videos: Sequence[tuple[str | os.PathLike, str]]) -> None:
        """Video files (GIF) already written, each with a caption, to the sinks that show videos
        (wandb; TensorBoard's video summaries need moviepy, which diffrl does not depend on)."""
        step = self._check_open(step)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"video tag must be a non-empty string, got {tag!r}")
        files = [(Path(path), str(caption)) for path, caption in videos]
        missing = [str(path) for path, _ in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"log_videos: no such video file(s): {', '.join(missing[:3])}")
        for sink in self.sinks:
            sink.log_videos(step, tag, files)

    def _check_open(self, step: int) -> int:
        if self._closed:
            raise RuntimeError("RunLogger is closed")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return int(step)

    def close(self, failed: bool = False) -> None:
        """Close every sink (the console prints its summary); idempotent. The first error is re-raised."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close(failed)
            except BaseException as err:
                error = error or err
        if error is not None:
            raise error

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)
