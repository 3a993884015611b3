"""Image grids of samples (with optional captions) and PNG files.

Layout of `image_grid` (what the tests check pixel by pixel): tiles of size (tile_h, tile_w) sit
in `cols = min(nrow, B)` columns and `ceil(B / cols)` rows, row-major; tile i's top-left corner is

    y = padding + (i // cols) · (tile_h + caption_h + padding)
    x = padding + (i %  cols) · (tile_w + padding)

The gaps and the border are `pad_value`; each caption is a white strip of `caption_h` pixels under
its tile (0 without captions), black text, wrapped to the tile width (at most `caption_lines`
lines, the last one cut with "…"). `scale` enlarges every tile by pixel repetition first. A
video tile is its first frame (`frames="first"`) or up to `max_frames` evenly spaced frames side
by side (`frames="strip"`, tile_w = frames · W).

`save_gif` writes one video as an animated GIF (Pillow), which any browser or image viewer plays.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from diffrl.files import atomic_file

ArrayLike = torch.Tensor | np.ndarray


def _as_uint8_numpy(pixels: ArrayLike, what: str) -> np.ndarray:
    if isinstance(pixels, torch.Tensor):
        if pixels.dtype != torch.uint8:
            raise ValueError(
                f"{what} must be uint8 (0..255), got {pixels.dtype}; convert with (x * 255).round().to(torch.uint8)"
            )
        return pixels.detach().cpu().numpy()
    if isinstance(pixels, np.ndarray):
        if pixels.dtype != np.uint8:
            raise ValueError(f"{what} must be uint8 (0..255), got {pixels.dtype}")
        return pixels
    raise TypeError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(pixels).__name__}")


def _to_rgb_BHWC(images_BCHW: np.ndarray) -> np.ndarray:
    channels = images_BCHW.shape[1]
    if channels == 1:
        images_BCHW = np.repeat(images_BCHW, 3, axis=1)
    elif channels == 4:
        images_BCHW = images_BCHW[:, :3]  # drop alpha
    elif channels != 3:
        raise ValueError(f"images must have 1, 3 or 4 channels (dim 1 of BCHW), got {channels}")
    return np.ascontiguousarray(images_BCHW.transpose(0, 2, 3, 1))


def _tiles_BHWC(pixels: ArrayLike, frames: Literal["first", "strip"], max_frames: int) -> np.ndarray:
    """(B, tile_h, tile_w, 3) uint8 tiles from BCHW images or BTCHW videos."""
    array = _as_uint8_numpy(pixels, "pixels")
    if array.ndim == 4:
        return _to_rgb_BHWC(array)
    if array.ndim != 5:
        raise ValueError(
            f"pixels must be images (B, C, H, W) or videos (B, T, C, H, W), got shape {tuple(array.shape)}"
        )
    num_frames = array.shape[1]
    if num_frames == 0:
        raise ValueError("videos have no frames (T = 0)")
    if frames == "first":
        return _to_rgb_BHWC(array[:, 0])
    if frames != "strip":
        raise ValueError(f"frames must be 'first' or 'strip', got {frames!r}")
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    count = min(num_frames, max_frames)
    index = np.unique(np.linspace(0, num_frames - 1, count).round().astype(int))
    strip_BHWC = [_to_rgb_BHWC(array[:, t]) for t in index]
    return np.concatenate(strip_BHWC, axis=2)  # frames side by side along the width


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ValueError, ImportError, OSError):  # no FreeType: Pillow's fixed bitmap font
        return ImageFont.load_default()


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels, at most `max_lines` lines (the last cut with '…'); a
    newline in `text` starts a new line."""
    if "\n" in text:
        lines = []
        for part in text.split("\n"):
            lines.extend(_wrap(part, font, width, max_lines - len(lines)) or [""])
            if len(lines) >= max_lines:
                break
        return lines[:max_lines]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    fits = lambda s: measure.textlength(s, font=font) <= width  # noqa: E731
    lines: list[str] = []
    words = text.split()
    current = ""
    while words:
        word = words[0]
        candidate = f"{current} {word}" if current else word
        if fits(candidate):
            current = candidate
            words.pop(0)
            continue
        if not current:  # a single word wider than the tile: cut it by characters
            cut = len(word)
            while cut > 1 and not fits(word[:cut]):
                cut -= 1
            current, words[0] = word[:cut], word[cut:]
        lines.append(current)
        current = ""
        if len(lines) == max_lines:
            break
    if current and len(lines) < max_lines:
        lines.append(current)
    if words and lines:  # text left over: mark the cut on the last line
        last = lines[-1]
        while last and not fits(last + "…"):
            last = last[:-1]
        lines[-1] = last + "…"
    return lines


def image_grid(
    pixels: ArrayLike,
    nrow: int = 8,
    captions: Sequence[str] | None = None,
    *,
    padding: int = 2,
    pad_value: int = 0,
    frames: Literal["first", "strip"] = "first",
    max_frames: int = 8,
    caption_lines: int = 2,
    font_size: int = 12,
    scale: int = 1,
) -> np.ndarray:
    """One (H, W, 3) uint8 RGB image of B samples, `nrow` per row (layout in the module docstring).

    pixels: uint8 images (B, C, H, W) or videos (B, T, C, H, W), C in {1, 3, 4}, tensor or array.
    captions: one string per sample (e.g. prompt and reward), drawn under its tile; None = none.
    scale: each tile enlarged `scale` times by pixel repetition (nearest neighbour: no smoothing
    that would hide what a verifier saw), so that small images (32² toy samples) leave room for
    a readable caption; the layout's tile_h, tile_w are the enlarged sizes.
    """
    if scale < 1:
        raise ValueError(f"scale must be an integer >= 1, got {scale}")
    tiles_BHWC = _tiles_BHWC(pixels, frames, max_frames)
    if scale > 1:
        tiles_BHWC = tiles_BHWC.repeat(scale, axis=1).repeat(scale, axis=2)
    count, tile_h, tile_w, _ = tiles_BHWC.shape
    if count == 0:
        raise ValueError("image_grid needs at least one image (B = 0)")
    if nrow < 1:
        raise ValueError(f"nrow (images per row) must be >= 1, got {nrow}")
    if padding < 0 or not 0 <= pad_value <= 255:
        raise ValueError(f"padding must be >= 0 and pad_value in [0, 255], got {padding}, {pad_value}")
    if captions is not None and len(captions) != count:
        raise ValueError(f"got {len(captions)} captions for {count} images: give one per image")
    cols = min(nrow, count)
    rows = math.ceil(count / cols)

    font = caption_h = line_h = None
    if captions is not None:
        if caption_lines < 1:
            raise ValueError(f"caption_lines must be >= 1, got {caption_lines}")
        font = _font(font_size)
        ascent, descent = font.getmetrics()
        line_h = ascent + descent + 1
        caption_h = caption_lines * line_h + 4
    caption_h = caption_h or 0

    grid_HWC = np.full(
        (padding + rows * (tile_h + caption_h + padding), padding + cols * (tile_w + padding), 3),
        pad_value,
        dtype=np.uint8,
    )
    for i in range(count):
        y = padding + (i // cols) * (tile_h + caption_h + padding)
        x = padding + (i % cols) * (tile_w + padding)
        grid_HWC[y : y + tile_h, x : x + tile_w] = tiles_BHWC[i]
        if captions is not None:
            strip = Image.new("RGB", (tile_w, caption_h), (255, 255, 255))
            draw = ImageDraw.Draw(strip)
            for k, line in enumerate(_wrap(str(captions[i]), font, tile_w - 4, caption_lines)):
                draw.text((2, 2 + k * line_h), line, fill=(0, 0, 0), font=font)
            grid_HWC[y + tile_h : y + tile_h + caption_h, x : x + tile_w] = np.asarray(strip)
    return grid_HWC


def save_png(path: str | os.PathLike, image_HWC: ArrayLike) -> Path:
    """Write a uint8 (H, W), (H, W, 1|3|4) image as PNG, atomically (temp file + rename); returns the path."""
    array = _as_uint8_numpy(image_HWC, "image")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise ValueError(f"image must be (H, W) or (H, W, C) with C in 1/3/4, got shape {tuple(array.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        Image.fromarray(np.ascontiguousarray(array)).save(tmp, format="PNG")
    return path


def save_gif(path: str | os.PathLike, video_T3HW: ArrayLike, fps: float) -> Path:
    """Write a uint8 video `[T, 3, H, W]` as an animated GIF that loops, atomically; returns the path.

    GIF stores at most 256 colours per frame: Pillow quantises each frame to its own palette, so a
    frame with more colours than that comes back approximately (one with fewer comes back exactly).
    GIF delays are whole centiseconds, so the frame time is 1000/fps ms rounded to one (16 fps:
    60 ms). Pillow stores consecutive identical frames once, with their delays summed: the
    playback time is kept, the frame count read back may be lower.
    """
    array = _as_uint8_numpy(video_T3HW, "video")
    if array.ndim != 4 or array.shape[1] != 3 or array.shape[0] == 0:
        raise ValueError(f"video must be (T, 3, H, W) with T >= 1, got shape {tuple(array.shape)}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = [Image.fromarray(np.ascontiguousarray(frame.transpose(1, 2, 0))) for frame in array]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        frames[0].save(
            tmp,
            format="GIF",
            save_all=True,
            append_images=frames[1:],
            duration=max(10, round(100 / fps) * 10),
            loop=0,
        )
    return path
