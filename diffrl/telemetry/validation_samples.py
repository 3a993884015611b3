"""What a validation writes of its samples: the rows, the captioned grid, the videos' GIFs and page.

Each validation (`diffrl.controller.validation`) turns its samples into one row each
(`validation_samples`: prompt, data source, reward, the verifier's verdict), writes them as JSON
lines beside a captioned grid (`validation_grid`, laid out by `grid_layout`, one row per data
source) and, for a video model, every sample as a GIF with an HTML page that plays them
(`validation_videos`). The end-of-run report and `diffrl eval` read those files back
(`read_samples`, `verdict_label`). Apart from `report` because these are written during training,
at every validation, while the report is made once from the files afterwards.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffrl.files import atomic_write_text

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


__all__ = [
    "grid_layout",
    "prompt_slug",
    "read_samples",
    "sample_caption",
    "validation_grid",
    "validation_samples",
    "validation_videos",
    "verdict_label",
]
