"""The end-of-run report: what changed between the first and the last validation, with pictures.

`write_report(run_dir)` reads the run's own files (metrics.jsonl and the validation grids), so it
works for any finished or interrupted run, and writes:

- `report.json`: the first and last validation's metrics side by side (every `val/...` key);
- `reward_curve.png`: the training reward mean per step, with the validation reward (and the
  shapes verifier's held-out accuracy, when logged) as points;
- `before_after.png`: the first and the last validation grid side by side; validation uses fixed
  seeds, so each tile pair is the same prompt from the same noise, before and after training;

and returns a few lines of text for the console. The curve is drawn with Pillow (a line plot
needs no plotting library).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from diffrl.telemetry.sinks import format_value, read_metrics

TRAIN_REWARD = "rewards/mean"
VAL_REWARD = "val/rewards/mean"
#: Validation metrics shown in the console summary when present, in this order.
HEADLINE = ("val/rewards/mean", "val/accuracy")


def add_accuracy(metrics: dict[str, float]) -> dict[str, float]:
    """Add `val/accuracy` to one validation's metrics: the mean over data sources of their
    `val/<source>/accuracy` (the shapes verifier's per category), every category weighted equally.
    The validation logs it and the console and this report show it: one definition everywhere."""
    per_source = [v for k, v in metrics.items() if _is_source_accuracy(k)]
    if per_source:
        metrics["val/accuracy"] = sum(per_source) / len(per_source)
    return metrics


def _is_source_accuracy(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "val" and parts[2] == "accuracy" and parts[1] != "rewards"


def validation_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The `val/...` entries of one step's metrics, with `val/accuracy` (`add_accuracy`; computed
    here too for runs logged before validation logged it)."""
    val = {k: v for k, v in metrics.items() if k.startswith("val/") and isinstance(v, int | float)}
    return add_accuracy(val) if "val/accuracy" not in val else val


def _change(before: float, after: float, same: bool) -> str:
    return f"{after:.2f}" if same else f"{before:.2f}→{after:.2f}"


def write_report(run_dir: str | Path) -> str:
    """Write report.json, reward_curve.png and before_after.png into `run_dir`; returns the summary text."""
    run_dir = Path(run_dir)
    steps = read_metrics(run_dir / "metrics.jsonl")
    validations = {s: validation_metrics(m) for s, m in steps.items() if VAL_REWARD in m}
    lines = []
    report: dict = {"run_dir": str(run_dir)}
    if validations:
        first, last = min(validations), max(validations)
        report.update(
            {
                "before_step": first,
                "after_step": last,
                "before": validations[first],
                "after": validations[last],
            }
        )
        for key in HEADLINE:
            if key not in validations[last]:
                continue
            after = format_value(validations[last][key])
            if first == last:
                lines.append(f"{key}: {after} (step {last}, the only validation)")
            else:
                before = format_value(validations[first].get(key, math.nan))
                lines.append(f"{key}: {before} (step {first}) → {after} (step {last})")
        sources = sorted(k for k in validations[last] if _is_source_accuracy(k))
        if sources:
            lines.append(
                "val/<category>/accuracy: "
                + ", ".join(
                    f"{k.split('/')[1]} {_change(validations[first].get(k, math.nan), validations[last][k], first == last)}"
                    for k in sources
                )
            )
        grids = [run_dir / "validation" / f"step_{s:06d}.png" for s in (first, last)]
        if first != last and all(g.is_file() for g in grids):
            side_by_side(grids, [f"step {first}", f"step {last}"], run_dir / "before_after.png")
            lines.append(f"before/after samples: {run_dir / 'before_after.png'}")
    curve = {s: m[TRAIN_REWARD] for s, m in steps.items() if TRAIN_REWARD in m}
    if curve or validations:
        series = [(TRAIN_REWARD, curve, (31, 119, 180))]
        series.append((VAL_REWARD, {s: v[VAL_REWARD] for s, v in validations.items()}, (214, 39, 40)))
        if any("val/accuracy" in v for v in validations.values()):
            accuracy = {s: v["val/accuracy"] for s, v in validations.items() if "val/accuracy" in v}
            series.append(("val/accuracy", accuracy, (44, 160, 44)))
        line_plot(series, run_dir / "reward_curve.png", title=run_dir.name)
        lines.append(f"reward curve: {run_dir / 'reward_curve.png'}")
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return "\n".join(lines)


def finished_run(run_dir: str | Path, total_steps: int) -> str | None:
    """When `run_dir` holds a run that already completed `total_steps` (its summary.json, written
    at the very end, says so), the message to print instead of starting it again; else None.

    Cheap (reads one JSON file), so `diffrl train`/`sft` call it before loading any model."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    try:
        steps = json.loads(path.read_text(encoding="utf-8"))["steps"]
    except (ValueError, KeyError, TypeError):
        return None  # not a summary this code wrote: let the normal start decide
    if not isinstance(steps, int) or steps < total_steps:
        return None
    lines = [
        f"run {run_dir} is already finished at step {steps} (trainer.total_steps={total_steps}): nothing to "
        "do. Raise trainer.total_steps to train it further, or choose another trainer.run_name."
    ]
    if (Path(run_dir) / "report.json").is_file():
        lines.append(f"its report: {Path(run_dir) / 'report.json'}")
    return "\n".join(lines)


def skip_if_finished(trainer: Any) -> Path | None:
    """For `diffrl train` / `diffrl sft` before anything loads: when `trainer` (the config's
    `trainer` section) names a run (`run_name`, `resume=auto`) that already finished
    `total_steps`, print that and return the run directory; otherwise None (start or resume)."""
    if trainer.run_name is None or trainer.resume != "auto":
        return None
    run_dir = Path(trainer.output_dir) / trainer.run_name
    message = finished_run(run_dir, trainer.total_steps)
    if message is None:
        return None
    print(message, flush=True)
    return run_dir


def side_by_side(images: list[Path], labels: list[str], out: Path) -> Path:
    """The images next to each other, each with its label above it."""
    opened = [Image.open(p).convert("RGB") for p in images]
    font = ImageFont.load_default()
    label_h, gap = 16, 8
    width = sum(i.width for i in opened) + gap * (len(opened) + 1)
    height = max(i.height for i in opened) + label_h + 2 * gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = gap
    for image, label in zip(opened, labels, strict=True):
        draw.text((x, gap // 2), label, fill="black", font=font)
        canvas.paste(image, (x, gap + label_h))
        x += image.width + gap
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out)
    return out


def line_plot(
    series: list[tuple[str, dict[int, float], tuple[int, int, int]]],
    out: Path,
    *,
    title: str = "",
    size: tuple[int, int] = (640, 400),
) -> Path:
    """A line plot of `(label, {step: value}, rgb)` series sharing one x (step) and one y axis."""
    width, height = size
    left, right, top, bottom = 60, 20, 30, 50
    points = [(s, v) for _, data, _ in series for s, v in data.items() if math.isfinite(v)]
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((left, 8), title, fill="black", font=font)
    if not points:
        image.save(out)
        return out
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def xy(step: float, value: float) -> tuple[float, float]:
        return (
            left + (step - x_lo) / (x_hi - x_lo) * (width - left - right),
            top + (y_hi - value) / (y_hi - y_lo) * (height - top - bottom),
        )

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for i in range(5):  # y ticks
        value = y_lo + (y_hi - y_lo) * i / 4
        y = xy(x_lo, value)[1]
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((4, y - 6), f"{value:.3g}", fill="black", font=font)
    for i in range(5):  # x ticks
        step = x_lo + (x_hi - x_lo) * i / 4
        x = xy(step, y_lo)[0]
        draw.line([x, height - bottom, x, height - bottom + 4], fill="black")
        draw.text((x - 10, height - bottom + 6), f"{step:.0f}", fill="black", font=font)
    draw.text((width // 2 - 10, height - 18), "step", fill="black", font=font)
    legend_x = left + 8
    for label, data, color in series:
        coords = [xy(s, v) for s, v in sorted(data.items()) if math.isfinite(v)]
        if len(coords) > 1:
            draw.line(coords, fill=color, width=2)
        for cx, cy in coords if len(coords) < 40 else []:
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        draw.text((legend_x, top + 4), label, fill=color, font=font)
        legend_x += 8 * len(label) + 16
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    return out


__all__ = [
    "add_accuracy",
    "finished_run",
    "line_plot",
    "side_by_side",
    "skip_if_finished",
    "validation_metrics",
    "write_report",
]
