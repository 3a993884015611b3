"""Training images for supervised flow matching: read from files, or rendered shapes-world scenes.

`load_image_rows` is a plain function of picklable arguments so that `diffrl sft` can run it in
worker processes (`sft.data_workers`), a few steps ahead of training: rendering or decoding
images on the training process would leave a fast GPU idle most of the time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from diffrl.files import open_regular

SHAPES = "shapes"


@contextmanager
def open_image(path: Path, what: str) -> Iterator[Any]:
    """A dataset image opened with Pillow (headers read; pixels on demand), `what` naming where
    it comes from. A file Pillow cannot read, or one over the pixel count Pillow opens at all (its
    decompression-bomb cap, twice `PIL.Image.MAX_IMAGE_PIXELS`), is a ValueError naming the file
    and the fix, not Pillow's own exception."""
    from PIL import Image, UnidentifiedImageError

    with open_regular(path, what) as file:
        try:
            image = Image.open(file)
        except Image.DecompressionBombError:
            cap = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
            raise ValueError(
                f"{what} {path} has more pixels than images can safely be opened with ({cap:,}): it "
                "cannot be a training image (they have the training size, "
                "rollout.pipeline.width x height): resize it, or remove the row"
            ) from None
        except UnidentifiedImageError:
            raise ValueError(
                f"{what} {path} is not an image Pillow can read (PNG, JPEG, WebP, ...): replace the "
                "file, or remove the row"
            ) from None
        with image:
            yield image


def load_image_rows(
    source: str, rows: Sequence[dict | str], height: int, width: int, seeds: Sequence[int]
) -> np.ndarray:
    """uint8 [N, H, W, 3]. `source` "shapes": rows are scene dicts, rendered with a numpy generator
    seeded by the row's seed; otherwise rows are image paths, checked to be H x W."""
    images = []
    for row, seed in zip(rows, seeds, strict=True):
        if source == SHAPES:
            from diffrl.toy.grammar import Scene
            from diffrl.toy.render import render

            images.append(render(Scene.from_dict(row), size=height, generator=np.random.default_rng(seed)))
        else:
            with open_image(Path(row), "image") as image:
                if image.size != (width, height):
                    raise ValueError(
                        f"{row} is {image.size[0]}x{image.size[1]} but training runs at {width}x{height} "
                        "(rollout.pipeline.width x height): resize the dataset's images, or change the size"
                    )
                images.append(np.array(image.convert("RGB")))
    return np.stack(images)


__all__ = ["SHAPES", "load_image_rows", "open_image"]
