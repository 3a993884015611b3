"""Training images for supervised flow matching: read from files, or rendered shapes-world scenes.

`load_image_rows` is a plain function of picklable arguments so that `diffrl sft` can run it in
worker processes (`sft.data_workers`), a few steps ahead of training: rendering or decoding
images on the training process would leave a fast GPU idle most of the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffrl.files import open_regular

SHAPES = "shapes"


def load_image_rows(
    source: str, rows: Sequence[dict | str], height: int, width: int, seeds: Sequence[int]
) -> np.ndarray:
    """uint8 [N, H, W, 3]. `source` "shapes": rows are scene dicts, rendered with a numpy generator
    seeded by the row's seed; otherwise rows are image paths, checked to be H x W."""
    from PIL import Image

    images = []
    for row, seed in zip(rows, seeds, strict=True):
        if source == SHAPES:
            from diffrl.toy.grammar import Scene
            from diffrl.toy.render import render

            images.append(render(Scene.from_dict(row), size=height, generator=np.random.default_rng(seed)))
        else:
            with open_regular(Path(row), "image") as file, Image.open(file) as image:
                if image.size != (width, height):
                    raise ValueError(
                        f"{row} is {image.size[0]}x{image.size[1]} but training runs at {width}x{height} "
                        "(rollout.pipeline.width x height): resize the dataset's images, or change the size"
                    )
                images.append(np.array(image.convert("RGB")))
    return np.stack(images)


__all__ = ["SHAPES", "load_image_rows"]
