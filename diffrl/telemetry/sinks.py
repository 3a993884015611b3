"""The places metrics go: console, metrics.jsonl, TensorBoard, Weights & Biases.

Each sink has `log(step, metrics)`, `log_images(step, tag, image_HWC)`, `log_videos(step, tag,
videos)` and `close(failed)`; `RunLogger` validates the values once and fans them out. Files open on a sink's first call, whose
step starts a new history (see `JsonlSink` and `TensorBoardSink` for what a resume does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from diffrl.files import atomic_write_text, naming
from diffrl.telemetry.console import format_duration

log = logging.getLogger(__name__)

# JSON has no NaN or infinity: metrics.jsonl writes them as these strings (float() reads them back).
NONFINITE_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def format_value(x: float) -> str:
    """Compact: 4 significant digits, scientific below 1e-3 or from 1e5, `nan`/`inf` as such."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:.4g}"


# ------------------------------------------------------------------------------------ console
class ConsoleSink:
    """One progress line per `log` call, and a summary line on close.

        step 12/300 | rewards/mean 0.613 (+0.05) | val/rewards/mean 0.58 | val/accuracy 0.31 |
        actor/loss -0.002 | actor/kl 1.00e-04 | actor/grad_norm 0.41 | 8.4 s/step | 0.95 img/s/gpu |
        mfu 31.2% | ETA 34m43s

    Fields are named by their metric, as in metrics.jsonl and the report, and appear when it was
    logged (`KEY_METRICS`); the reward's bracket is its change since the previous line. ETA = mean wall time per step over the last `window` step-to-step
    intervals × steps left (before the second step: the step's own `timing_s/step`). A non-finite
    metric is named at the end of the line.
    """

    #: Metrics shown on each line when logged, in this order.
    KEY_METRICS: tuple[str, ...] = (
        "rewards/mean",
        "val/rewards/mean",
        "val/accuracy",  # the shapes verifier's held-out accuracy, mean over categories
        "actor/loss",
        "actor/kl",
        "actor/grad_norm",
    )
    #: Metrics whose first and last values the closing line compares. Validation is not among them:
    #: the end-of-run report (telemetry/report.py) states it, once.
    SUMMARY_METRICS: tuple[str, ...] = ("rewards/mean",)

    def __init__(
        self,
        *,
        total_steps: int,
        run_name: str,
        run_dir: Path,
        window: int = 10,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps = total_steps
        self.run_name = run_name
        self.run_dir = run_dir
        self._stream = stream
        self._clock = clock
        self._opened = clock()
        self._intervals: deque[float] = deque(maxlen=window)
        self._last: tuple[int, float] | None = None  # (step, time of its latest line)
        self._first_step: int | None = None
        self._steps_logged: set[int] = set()
        self._first: dict[str, tuple[int, float]] = {}  # metric -> (step, value)
        self._latest: dict[str, tuple[int, float]] = {}
        self._prev_reward: float | None = None

    def _print(self, line: str) -> None:
        print(line, file=self._stream or sys.stdout, flush=True)

    def seconds_per_step(self, metrics: Mapping[str, float]) -> float | None:
        if self._intervals:
            return sum(self._intervals) / len(self._intervals)
        step_s = metrics.get("timing_s/step")
        return step_s if step_s is not None and math.isfinite(step_s) else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = self._clock()
        if self._last is not None and step > self._last[0]:
            self._intervals.append((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)
        if self._first_step is None:
            self._first_step = step
        self._steps_logged.add(step)
        for key in self.SUMMARY_METRICS:
            if key in metrics:
                self._first.setdefault(key, (step, metrics[key]))
                self._latest[key] = (step, metrics[key])

        parts = [f"step {step}/{self.total_steps}"]
        for name in self.KEY_METRICS:
            if name not in metrics:
                continue
            text = f"{name} {format_value(metrics[name])}"
            if name == "rewards/mean":
                if self._prev_reward is not None:
                    delta = metrics[name] - self._prev_reward
                    text += f" ({'+' if delta >= 0 else ''}{format_value(delta)})"
                self._prev_reward = metrics[name]
            parts.append(text)
        if "timing_s/step" in metrics:
            parts.append(f"{format_value(metrics['timing_s/step'])} s/step")
        if "throughput/images_per_s_per_gpu" in metrics:
            parts.append(f"{format_value(metrics['throughput/images_per_s_per_gpu'])} img/s/gpu")
        if "perf/mfu/step" in metrics:
            parts.append(f"mfu {100 * metrics['perf/mfu/step']:.1f}%")
        per_step = self.seconds_per_step(metrics)
        remaining = max(0, self.total_steps - step)
        parts.append(f"ETA {format_duration(per_step * remaining) if per_step is not None else '?'}")
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
            parts.append(f"non-finite: {', '.join(bad[:3])}{more}")
        self._print(" | ".join(parts))

    def log_images(self, step: int, tag: str, image_HWC: np.ndarray) -> None:
        pass  # images go to TensorBoard / wandb; the trainer saves its PNGs itself

    def log_videos(self, step: int, tag: str, videos: Sequence[tuple[Path, str]]) -> None:
        pass  # the validation writes the GIFs itself

    def close(self, failed: bool = False) -> None:
        elapsed = format_duration(self._clock() - self._opened)
        if self._last is None:
            self._print(f"run {self.run_name}: no steps logged ({elapsed}) | {self.run_dir}")
            return
        last = self._last[0]
        head = (
            f"run {self.run_name} stopped by an error at step {last}"
            if failed
            else f"run {self.run_name} done"
        )
        parts = [f"{head}: steps {self._first_step}-{last} in {elapsed}"]
        if self._intervals:
            parts[0] += f" ({format_value(sum(self._intervals) / len(self._intervals))} s/step recently)"
        for key in self.SUMMARY_METRICS:
            if key in self._latest:
                (s0, v0), (s1, v1) = self._first[key], self._latest[key]
                change = f"{format_value(v0)} (step {s0}) → " if s0 != s1 else ""
                parts.append(f"{key} {change}{format_value(v1)} (step {s1})")
        parts.append(str(self.run_dir))
        self._print(" | ".join(parts))


# -------------------------------------------------------------------------------------- jsonl
def _json_value(value: float) -> float | str:
    return value if math.isfinite(value) else NONFINITE_JSON[str(value)]


def _decode_value(value: Any) -> Any:
    if isinstance(value, str) and value in NONFINITE_JSON.values():
        return float(value)
    return value


def _parse_record(line: str) -> dict[str, Any] | None:
    """The record of one line, or None if the line is not a complete record (e.g. cut by a crash)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return {key: _decode_value(value) for key, value in record.items()}


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl in file order, non-finite strings read back as floats.

    A last line cut short by a crash is skipped; a bad line anywhere else raises ValueError.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _parse_record(line)
        if record is None:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a metrics record: {line[:120]!r}")
        records.append(record)
    return records


def read_metrics(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """{step: metrics} of a metrics.jsonl, sorted by step; records of one step merge (later keys win).

    This is how to read the file: a step may have several records (e.g. one with validation
    metrics logged separately), and `time` is the latest record's.
    """
    merged: dict[int, dict[str, Any]] = {}
    for record in read_jsonl(path):
        step = record.pop("step")
        merged.setdefault(step, {}).update(record)
    return dict(sorted(merged.items()))


class JsonlSink:
    """`metrics.jsonl`: one JSON object per `log` call, `{"step": s, "time": unix_s, **metrics}`.

    Every line is flushed and fsync'ed as written, so a crash loses nothing already logged. Non-finite
    values are the strings "NaN", "Infinity", "-Infinity" (JSON has no such numbers; `float()` and
    `read_jsonl` read them back).

    Resume: the file is appended to, and the first step this sink writes starts a new history:
    records of steps >= that step left by an earlier attempt (logged after its last checkpoint,
    before it died) are removed first (the file is rewritten atomically), as is a last line cut by
    a crash. So after a resume every step appears once per `log` call of the run that finally
    produced it, and steps increase down the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self.dropped = 0  # records removed on open (earlier attempts' steps >= the first new one)

    def _open(self, first_step: int) -> TextIO:
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = []
            for line in lines:
                record = _parse_record(line)
                if record is not None and record["step"] < first_step:
                    kept.append(line)
            self.dropped = len(lines) - len(kept)
            if self.dropped:
                atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
                log.warning(
                    "%s: removed %d record(s) of steps >= %d left by an earlier attempt of this run",
                    self.path,
                    self.dropped,
                    first_step,
                )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "a", encoding="utf-8")  # held open for the run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            self._file = self._open(step)
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({key: _json_value(value) for key, value in metrics.items()})
        with naming(self.path):
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def log_images(self, step: int, tag: str, image_HWC: np.ndarray) -> None:
        pass

    def log_videos(self, step: int, tag: str, videos: Sequence[tuple[Path, str]]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# -------------------------------------------------------------------------------- tensorboard
class TensorBoardSink:
    """TensorBoard event files in `log_dir` (scalars, images, the config as text), flushed every call.

    Resume: when `log_dir` already holds event files, the writer opens with `purge_step` = the first
    step it writes, so TensorBoard hides the earlier attempt's events of steps >= it.
    """

    def __init__(self, log_dir: Path, config: Mapping[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises this when the tensorboard package is missing
            raise ImportError(
                "trainer.loggers includes 'tensorboard' but the tensorboard package is not installed: "
                "pip install tensorboard (or remove tensorboard from trainer.loggers)"
            ) from err
        self._writer_cls = SummaryWriter
        self.log_dir = log_dir
        self.config = config
        self._writer = None

    def _open(self, first_step: int):
        if self._writer is None:
            resumed = self.log_dir.is_dir() and any(self.log_dir.glob("events.out.tfevents.*"))
            self._writer = self._writer_cls(str(self.log_dir), purge_step=first_step if resumed else None)
            text = json.dumps(self.config, indent=2, default=str)
            self._writer.add_text(
                "config", "\n".join("    " + line for line in text.splitlines()), first_step
            )
        return self._writer

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        writer = self._open(step)
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def log_images(self, step: int, tag: str, image_HWC: np.ndarray) -> None:
        writer = self._open(step)
        writer.add_image(tag, image_HWC, step, dataformats="HWC")
        writer.flush()

    def log_videos(self, step: int, tag: str, videos: Sequence[tuple[Path, str]]) -> None:
        # SummaryWriter.add_video encodes with moviepy, which diffrl does not depend on; the grid of
        # first frames reaches TensorBoard through log_images, the GIFs sit in the run folder.
        pass

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# -------------------------------------------------------------------------------------- wandb
def import_wandb():
    """The wandb module, or ImportError naming the fix."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "trainer.loggers includes 'wandb' but the wandb package is not installed: pip install wandb "
            "(or remove wandb from trainer.loggers). WANDB_MODE=offline logs without a network."
        ) from err
    return wandb


class WandbSink:
    """A Weights & Biases run: the config, scalars and images.

    The project is `project` (trainer.project_name), else $WANDB_PROJECT, else "diffrl". Mode,
    entity, API key etc. come from wandb's own environment variables (`WANDB_MODE=offline`
    logs with no network; `wandb sync run_dir/wandb/offline-run-*` uploads later). The run id is kept
    in `run_dir/wandb_run_id`, so a resumed diffrl run continues the same wandb run; wandb itself
    drops records of steps lower than ones it already has, so after a resume from an earlier
    checkpoint the re-run steps keep the first attempt's values there (metrics.jsonl and TensorBoard
    hold the final ones).
    """

    def __init__(
        self, run_dir: Path, *, run_name: str, config: Mapping[str, Any], project: str | None
    ) -> None:
        self._wandb = import_wandb()
        id_file = run_dir / "wandb_run_id"
        if id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run = self._wandb.init(
            project=project or os.environ.get("WANDB_PROJECT", "diffrl"),
            name=run_name,
            id=run_id,
            resume="allow",
            config=dict(config),
            dir=str(run_dir),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_images(self, step: int, tag: str, image_HWC: np.ndarray) -> None:
        self.run.log({tag: self._wandb.Image(image_HWC)}, step=step)

    def log_videos(self, step: int, tag: str, videos: Sequence[tuple[Path, str]]) -> None:
        # wandb.Video takes the GIF file as it is (no re-encoding, no extra package)
        self.run.log(
            {tag: [self._wandb.Video(str(path), caption=caption, format="gif") for path, caption in videos]},
            step=step,
        )

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
