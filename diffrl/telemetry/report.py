"""The end-of-run report: what changed between the first and the last validation, with pictures.

`write_report(run_dir)` reads the run's own files (metrics.jsonl and the validation grids), so it
works for any finished or interrupted run, and writes:

- `report.json`: the first and last validation's metrics side by side (every `val/...` key) and,
  when validation recorded per-sample verdicts (`validation/step_XXXXXX.jsonl`, the shapes
  verifier's), the accuracy per category before and after with standard errors (`category_table`);
- `reward_curve.png`: the training reward per step, raw and smoothed (a trailing mean), with the
  validation reward, `val/accuracy` and each category's held-out accuracy at the validation steps;
- `before_after.png`: the first and the last validation grid side by side; validation uses fixed
  seeds, so each tile pair is the same prompt from the same noise, before and after training. Each
  grid (`diffrl.telemetry.validation_samples.validation_grid`) has one row per category, each tile
  captioned with its prompt and, under it, the verifier's verdict (pass / fail); each grid's label
  says how many of all its validation's samples passed (`verdict_label`);

and returns a few lines of text for the console. The pictures are drawn with Pillow
(`diffrl.telemetry.plots`: a line plot needs no plotting library).

A video model's validations also write every sample as a GIF with an HTML page that plays them
(`validation_samples.validation_videos`, `validation/step_XXXXXX/index.html`); the summary names
the last one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffrl.files import atomic_write_text
from diffrl.telemetry.plots import line_plot, side_by_side
from diffrl.telemetry.sinks import format_value, read_metrics
from diffrl.telemetry.validation_samples import read_samples, verdict_label

TRAIN_REWARD = "rewards/mean"
#: Line colours of the per-category held-out accuracies in reward_curve.png.
CATEGORY_COLORS = (
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
VAL_REWARD = "val/rewards/mean"
#: Validation metrics shown in the console summary when present, in this order.
HEADLINE = ("val/rewards/mean", "val/accuracy")


def add_accuracy(metrics: dict[str, float]) -> dict[str, float]:
    """Add `val/accuracy` to one validation's metrics: the mean over data sources of their
    `val/<source>/accuracy` (the shapes verifier's per category), every category weighted equally.
    The validation logs it and the console and this report show it: one definition everywhere."""
    per_source = [v for k, v in metrics.items() if is_source_accuracy(k)]
    if per_source:
        metrics["val/accuracy"] = sum(per_source) / len(per_source)
    return metrics


def is_source_accuracy(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "val" and parts[2] == "accuracy" and parts[1] != "rewards"


def validation_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The `val/...` entries of one step's metrics, with `val/accuracy` (`add_accuracy`; computed
    here too for runs logged before validation logged it)."""
    val = {k: v for k, v in metrics.items() if k.startswith("val/") and isinstance(v, int | float)}
    return add_accuracy(val) if "val/accuracy" not in val else val


def _change(before: float, after: float, same: bool) -> str:
    return f"{after:.2f}" if same else f"{before:.2f}→{after:.2f}"


def category_table(before: Sequence[Mapping], after: Sequence[Mapping]) -> dict[str, Any]:
    """Verifier accuracy per data source before and after, from two validations' sample rows
    (`validation_samples`, the same samples in the same order), with standard errors.

    Per source: n samples, accuracy p before/after, se = sqrt(p(1-p)/n) of the after value, and the
    change with its paired standard error sqrt(var(after_i - before_i) / n) (the same noise seeds
    before and after, so most samples keep their verdict and the change is measured more precisely
    than either value). `mean`: the same over sources weighted equally (`val/accuracy`), its se
    sqrt(Σ se²) / sources."""
    import numpy as np

    if len(before) != len(after) or any("correct" not in r for r in (*before, *after)):
        return {}
    sources: dict[str, list[int]] = {}
    for i, row in enumerate(after):
        sources.setdefault(row["data_source"], []).append(i)
    table: dict[str, Any] = {}
    for source, index in sorted(sources.items()):
        b = np.array([before[i]["correct"] for i in index], dtype=float)
        a = np.array([after[i]["correct"] for i in index], dtype=float)
        n = len(index)
        change = a - b
        table[source] = {
            "n": n,
            "before": float(b.mean()),
            "after": float(a.mean()),
            "se": float(np.sqrt(a.mean() * (1 - a.mean()) / n)),
            "change": float(change.mean()),
            "change_se": float(np.sqrt(change.var(ddof=1) / n)) if n > 1 else math.nan,
        }
    count = len(table)
    mean = {key: sum(entry[key] for entry in table.values()) / count for key in ("before", "after", "change")}
    mean["se"] = math.sqrt(sum(e["se"] ** 2 for e in table.values())) / count
    mean["change_se"] = math.sqrt(sum(e["change_se"] ** 2 for e in table.values())) / count
    mean["n"] = sum(e["n"] for e in table.values())
    return {"per_category": table, "mean": mean}


def format_table(table: Mapping[str, Any], first: int, last: int) -> list[str]:
    """The console lines of `category_table`."""
    lines = [
        f"held-out accuracy per category (verifier; step {first} → step {last}; ± standard error):",
        f"  {'category':<20}{'n':>5}{'before':>9}{'after':>9}{'change':>17}",
    ]
    rows = [*table["per_category"].items(), ("mean (val/accuracy)", table["mean"])]
    for name, e in rows:
        lines.append(
            f"  {name:<20}{e['n']:>5}{e['before']:>9.3f}{e['after']:>9.3f}"
            f"{e['change']:>+10.3f} ± {e['change_se']:.3f}"
        )
    return lines


def smooth(curve: Mapping[int, float], window: int) -> dict[int, float]:
    """Trailing mean over the last `window` steps (fewer at the start)."""
    steps = sorted(curve)
    return {
        s: sum(curve[t] for t in steps[max(0, i + 1 - window) : i + 1])
        / len(steps[max(0, i + 1 - window) : i + 1])
        for i, s in enumerate(steps)
    }


def _headline_lines(validations: dict[int, dict[str, float]], first: int, last: int) -> list[str]:
    """HEADLINE metrics and the per-category accuracies, first -> last validation."""
    lines = []
    for key in HEADLINE:
        if key not in validations[last]:
            continue
        after = format_value(validations[last][key])
        if first == last:
            lines.append(f"{key}: {after} (step {last}, the only validation)")
        else:
            before = format_value(validations[first].get(key, math.nan))
            lines.append(f"{key}: {before} (step {first}) → {after} (step {last})")
    sources = sorted(k for k in validations[last] if is_source_accuracy(k))
    if sources:
        changes = (
            f"{k.split('/')[1]} {_change(validations[first].get(k, math.nan), validations[last][k], first == last)}"
            for k in sources
        )
        lines.append("val/<category>/accuracy: " + ", ".join(changes))
    return lines


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
        samples = [run_dir / "validation" / f"step_{s:06d}.jsonl" for s in (first, last)]
        table = None
        if first != last and all(path.is_file() for path in samples):
            table = category_table(read_samples(samples[0]), read_samples(samples[1]))
        if table:  # per category and their mean (val/accuracy): the result, stated once
            report.update(table)
            lines.extend(format_table(table, first, last))
        else:
            lines.extend(_headline_lines(validations, first, last))
        grids = [run_dir / "validation" / f"step_{s:06d}.png" for s in (first, last)]
        if first != last and all(g.is_file() for g in grids):
            labels = [
                verdict_label(f"step {s}", path) for s, path in zip((first, last), samples, strict=True)
            ]
            side_by_side(grids, labels, run_dir / "before_after.png")
            lines.append(f"before/after samples: {run_dir / 'before_after.png'}")
        videos = run_dir / "validation" / f"step_{last:06d}" / "index.html"
        if videos.is_file():
            lines.append(f"validation videos: {videos}")
    curve = {s: m[TRAIN_REWARD] for s, m in steps.items() if TRAIN_REWARD in m}
    if curve or validations:
        line_plot(reward_curve_series(curve, validations), run_dir / "reward_curve.png", title=run_dir.name)
        lines.append(f"reward curve: {run_dir / 'reward_curve.png'}")
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return "\n".join(lines)


def reward_curve_series(
    curve: Mapping[int, float], validations: Mapping[int, Mapping[str, float]]
) -> list[tuple[str, dict[int, float], tuple[int, int, int], int, bool]]:
    """The reward curve's series, `(label, {step: value}, rgb, line width, connect)`: the training
    reward, its trailing mean (only where there are more steps than the window), the validation
    reward, `val/accuracy` and each category's accuracy. Validations are joined by lines only from
    three on: a line between two of them would read as a trend measured in between. A series whose
    values equal an earlier one's (the shapes verifier's reward is its accuracy) says so in its
    label, since its line lies under the other."""
    window = max(3, round(len(curve) / 5))  # 20 steps: a mean of 4
    series = [(TRAIN_REWARD, dict(curve), (174, 199, 232), 1, True)]
    if len(curve) > window:
        series.append(
            (f"{TRAIN_REWARD}, mean of {window} steps", smooth(curve, window), (31, 119, 180), 3, True)
        )
    checked = [
        (VAL_REWARD, {s: v[VAL_REWARD] for s, v in validations.items() if VAL_REWARD in v}, (214, 39, 40), 2)
    ]
    if any("val/accuracy" in v for v in validations.values()):
        accuracy = {s: v["val/accuracy"] for s, v in validations.items() if "val/accuracy" in v}
        checked.append(("val/accuracy", accuracy, (44, 160, 44), 3))
    sources = sorted({k for v in validations.values() for k in v if is_source_accuracy(k)})
    for key, color in zip(sources, CATEGORY_COLORS, strict=False):
        checked.append((key, {s: v[key] for s, v in validations.items() if key in v}, color, 1))
    for label, data, color, width in checked:
        same = next((other[0] for other in series if other[1] == data and data), None)
        series.append((f"{label} (= {same})" if same else label, data, color, width, len(data) >= 3))
    return series


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


__all__ = [
    "add_accuracy",
    "category_table",
    "finished_run",
    "format_table",
    "skip_if_finished",
    "smooth",
    "validation_metrics",
    "write_report",
]
