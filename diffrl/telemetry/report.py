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
  grid (`validation_grid`) has one row per category, each tile captioned with its prompt and,
  under it, the verifier's verdict (pass / fail); each grid's label says how many of all its
  validation's samples passed (`verdict_label`);

and returns a few lines of text for the console. The curve is drawn with Pillow (a line plot
needs no plotting library).

A video model's validations also write every sample as a GIF with an HTML page that plays them
(`validation_videos`, `validation/step_XXXXXX/index.html`); the summary names the last one.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from diffrl.files import atomic_file, atomic_write_text
from diffrl.telemetry.sinks import format_value, read_metrics

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


# ------------------------------------------------------------------------------ validation samples
#: Tiles per row of a validation grid: one row per data source (category), its first samples.
GRID_COLUMNS = 8
#: Tiles smaller than this (pixels) are enlarged by an integer factor so their captions fit.
GRID_MIN_TILE = 96


def validation_samples(
    prompts: Sequence[str], sources: Sequence[str], total_B: Any, extras: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """One row per validation sample: its index, prompt, data source, total reward and, when a
    reward reports a per-sample `accuracy` extra (the shapes verifier), `correct`: its verdict."""
    accuracy = next((v for k, v in extras.items() if k.endswith("/accuracy") and v.ndim == 1), None)
    rows = []
    for i, (prompt, source) in enumerate(zip(prompts, sources, strict=True)):
        row: dict[str, Any] = {"index": i, "prompt": prompt, "data_source": source}
        row["reward"] = float(total_B[i])
        if accuracy is not None and math.isfinite(float(accuracy[i])):
            row["correct"] = bool(float(accuracy[i]) >= 0.5)
        rows.append(row)
    return rows


def verdict_label(label: str, samples_path: Path) -> str:
    """`label`, and when the validation's sample rows there carry verdicts, how many passed:
    "step 20: 25/48 pass" (the whole validation, not only the tiles its grid shows)."""
    rows = read_samples(samples_path) if samples_path.is_file() else []
    if not rows or any("correct" not in row for row in rows):
        return label
    return f"{label}: {sum(bool(row['correct']) for row in rows)}/{len(rows)} pass"


def sample_caption(row: Mapping[str, Any]) -> str:
    """The prompt, and under it the verdict (`pass` / `fail`), or the reward without a verdict."""
    if "correct" in row:
        return f"{row['prompt']}\n{'pass' if row['correct'] else 'fail'}"
    return f"{row['prompt']}\nreward {row['reward']:.2f}"


def grid_layout(rows: Sequence[Mapping[str, Any]], columns: int = GRID_COLUMNS) -> list[int | None]:
    """Which sample fills each tile: one grid row per data source (in order of appearance), its
    first `columns` samples, distinct prompts before repeats; None = a blank tile."""
    seen: dict[str, int] = {}
    by_source: dict[str, list[tuple[int, int]]] = {}
    for row in rows:
        repeat = seen.get(row["prompt"], 0)
        seen[row["prompt"]] = repeat + 1
        by_source.setdefault(row["data_source"], []).append((repeat, row["index"]))
    if len(by_source) == 1:
        return [index for _, index in by_source.popitem()[1]][: columns * columns]
    layout: list[int | None] = []
    for samples in by_source.values():
        picked = [index for _, index in sorted(samples)[:columns]]
        layout.extend(picked + [None] * (columns - len(picked)))
    return layout


def validation_grid(
    pixels: Any,
    rows: Sequence[Mapping[str, Any]],
    samples_path: Path | None = None,
    conditions: Any = None,
):
    """The captioned grid of a validation (`grid_layout`, each tile with `sample_caption`); writes
    `rows` to `samples_path` (JSON lines) first when given, for the report's per-category table.
    `conditions` (image-edit models): uint8 [B, 3, H, W], each sample's condition image at the
    sample's size; each tile then shows it left of the result, a 2-pixel grey bar between them."""
    import numpy as np
    import torch

    from diffrl.telemetry.images import image_grid

    if samples_path is not None:
        samples_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(samples_path, "".join(json.dumps(row) + "\n" for row in rows))
    images = pixels.detach().cpu().numpy() if isinstance(pixels, torch.Tensor) else np.asarray(pixels)
    scale = max(1, -(-GRID_MIN_TILE // max(images.shape[-2:])))
    if conditions is not None and images.ndim == 4:
        sources = conditions.numpy() if isinstance(conditions, torch.Tensor) else np.asarray(conditions)
        if sources.shape != images.shape:
            raise ValueError(
                f"validation_grid: conditions {sources.shape} must have the samples' shape {images.shape}"
            )
        bar = np.full((*images.shape[:3], 2), 160, dtype=images.dtype)
        images = np.concatenate([sources, bar, images], axis=3)
    layout = grid_layout(rows)
    blank = np.full_like(images[0], 255)
    tiles = np.stack([images[i] if i is not None else blank for i in layout])
    captions = [sample_caption(rows[i]) if i is not None else "" for i in layout]
    return image_grid(
        tiles,
        nrow=GRID_COLUMNS,
        captions=captions,
        scale=scale,
        caption_lines=4,
        font_size=11,
        pad_value=160,
    )


#: Frames per second of the validation GIFs: Wan2.1's (its pipelines' examples export at 16).
VIDEO_FPS = 16
_SLUG_LENGTH = 60


def prompt_slug(prompt: str) -> str:
    """A file-name-safe short form of a prompt: lower-case letters and digits, runs of anything
    else as one '-', at most 60 characters (the sidecar index keeps the whole prompt)."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")
    return slug[:_SLUG_LENGTH].rstrip("-") or "prompt"


def validation_videos(
    pixels_BT3HW: Any, rows: list[dict[str, Any]], folder: Path, fps: float = VIDEO_FPS
) -> list[Path]:
    """Write each validation sample's video to `folder` as `<index>_<prompt slug>.gif`, and
    `folder/index.html`, a page that plays them all with their prompt and reward. Adds to each row
    `video`: the GIF's path relative to `folder`'s parent (the validation folder), so the step's
    JSON lines (`validation_grid(..., samples_path)`, written after this) index the files too.
    Returns the GIF paths in sample order."""
    from diffrl.telemetry.images import save_gif

    if len(rows) != len(pixels_BT3HW):
        raise ValueError(f"got {len(rows)} sample rows for {len(pixels_BT3HW)} videos")
    folder.mkdir(parents=True, exist_ok=True)
    paths, figures = [], []
    for row, video in zip(rows, pixels_BT3HW, strict=True):
        path = save_gif(folder / f"{row['index']:03d}_{prompt_slug(row['prompt'])}.gif", video, fps)
        row["video"] = f"{folder.name}/{path.name}"
        paths.append(path)
        verdict = f" · {'pass' if row['correct'] else 'fail'}" if "correct" in row else ""
        figures.append(
            f'<figure><img src="{html.escape(path.name)}" alt="sample {row["index"]}">'
            f"<figcaption>{html.escape(row['prompt'])}<br>#{row['index']} · {html.escape(row['data_source'])}"
            f" · reward {row['reward']:.4f}{verdict}</figcaption></figure>"
        )
    title = html.escape(folder.name)
    page = (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>validation {title}</title>'
        "<style>body{font-family:sans-serif}figure{display:inline-block;margin:6px;max-width:440px;"
        "vertical-align:top}img{max-width:100%}</style></head><body>"
        f"<h1>validation {title}</h1>\n" + "\n".join(figures) + "\n</body></html>\n"
    )
    atomic_write_text(folder / "index.html", page)
    return paths


def read_samples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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
    with atomic_file(out) as tmp:
        canvas.save(tmp)
    return out


def nice_ticks(lo: float, hi: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values, 1, 2, 2.5 or 5 times a power of ten apart, from at or below `lo` to at or
    above `hi`, about `count` of them (an axis then reads 0, 0.25, 0.5, ... rather than 0.0469,
    0.211, ...). `integer`: whole-number steps only (training steps). A flat range gets one unit
    around it."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo or count < 2:
        raise ValueError(f"nice_ticks needs finite lo <= hi and count >= 2, got {lo}, {hi}, {count}")
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    power = math.floor(math.log10((hi - lo) / (count - 1)))
    multiples = (1, 2, 5) if integer else (1, 2, 2.5, 5)
    steps = sorted(m * 10.0**p for p in range(power - 1, power + 2) for m in multiples)
    if integer:
        steps = [step for step in steps if step >= 1 and step == round(step)] or [1.0]
    for step in steps:  # the finest step that needs at most count + 1 ticks
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first + 1 <= count + 1:
            break
    # round away float noise (0.30000000000000004) so labels print as the round numbers they are
    return [round(i * step, 10) for i in range(first, last + 1)]


def line_plot(
    series: Sequence[tuple],
    out: Path,
    *,
    title: str = "",
    size: tuple[int, int] = (800, 420),
) -> Path:
    """A line plot of `(label, {step: value}, rgb[, line width[, connect]])` series sharing one x
    (step) and one y axis; the legend is a column right of the plot. A series with connect=False
    is drawn as points only."""
    series = [(*entry, 2, True)[:5] if len(entry) == 3 else (*entry, True)[:5] for entry in series]
    width, height = size
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    legend_w = max((measure.textlength(entry[0], font=font) for entry in series), default=0)
    left, right, top, bottom = 60, int(legend_w) + 40, 30, 50
    points = [(s, v) for _, data, _, _, _ in series for s, v in data.items() if math.isfinite(v)]
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((left, 8), title, fill="black", font=font)
    if not points:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out) as tmp:
            image.save(tmp)
        return out
    x_ticks = nice_ticks(min(p[0] for p in points), max(p[0] for p in points), integer=True)
    y_ticks = nice_ticks(min(p[1] for p in points), max(p[1] for p in points))
    (x_lo, x_hi), (y_lo, y_hi) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])

    def xy(step: float, value: float) -> tuple[float, float]:
        return (
            left + (step - x_lo) / (x_hi - x_lo) * (width - left - right),
            top + (y_hi - value) / (y_hi - y_lo) * (height - top - bottom),
        )

    for value in y_ticks:
        y = xy(x_lo, value)[1]
        draw.line([left, y, width - right, y], fill=(225, 225, 225))  # grid: read values across
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((4, y - 6), f"{value:g}", fill="black", font=font)
    for step in x_ticks:
        x = xy(step, y_lo)[0]
        draw.line([x, height - bottom, x, height - bottom + 4], fill="black")
        draw.text((x - 10, height - bottom + 6), f"{step:g}", fill="black", font=font)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text((width // 2 - 10, height - 18), "step", fill="black", font=font)
    legend_x, legend_y = width - right + 12, top
    for label, data, color, line_width, connect in series:
        coords = [xy(s, v) for s, v in sorted(data.items()) if math.isfinite(v)]
        if connect and len(coords) > 1:
            draw.line(coords, fill=color, width=line_width)
        for cx, cy in coords if len(coords) < 40 or not connect else []:
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        draw.line([legend_x - 10, legend_y + 6, legend_x - 2, legend_y + 6], fill=color, width=line_width)
        draw.text((legend_x, legend_y), label, fill=color, font=font)
        legend_y += 14
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        image.save(tmp)
    return out


__all__ = [
    "add_accuracy",
    "category_table",
    "finished_run",
    "format_table",
    "grid_layout",
    "line_plot",
    "nice_ticks",
    "sample_caption",
    "side_by_side",
    "skip_if_finished",
    "smooth",
    "validation_grid",
    "validation_metrics",
    "validation_samples",
    "write_report",
]
