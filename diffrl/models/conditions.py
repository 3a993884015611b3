"""What an image-edit family takes as condition images, checked on the prompt rows before any model
loads (`ModelAdapter.condition_rule`; `diffrl train` and `diffrl sample --image` call
`check_condition_rows`).

Each family declares: how many condition images a row carries, the aspect ratios it takes, and the
size its pipeline encodes an image at (a function of the image's own size, no model needed). The
last one sets the number of condition tokens, and diffrl samples a step's prompts in batches and
trains on micro-batches of them: every row of a run must give the same condition size. A file
whose images would give several sizes fails here, naming the first row that differs.

The rows are given as plain values, (where, [(image name, width, height), ...]), so this module
needs neither the data loader nor Pillow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: One prompt row's condition images: (where the row is, [(image name, width, height), ...]).
ConditionRow = tuple[str, Sequence[tuple[str, int, int]]]


@dataclass(frozen=True)
class ConditionRule:
    """A family's rules on condition images (see the module docstring)."""

    family: str  # the pipeline class, for messages
    min_images: int
    max_images: int
    #: Largest max(width/height, height/width) taken, and why.
    max_aspect: float
    aspect_reason: str
    #: (width, height) of a condition image -> the (width, height) of each image the family's VAE
    #: encodes (the pipeline's resize), for the one-condition-size check.
    encoded_size: Callable[[int, int], tuple[int, int]]

    def count_text(self) -> str:
        if self.min_images == self.max_images:
            return f"exactly {self.min_images}"
        return f"{self.min_images} to {self.max_images}"


def check_condition_rows(rule: ConditionRule, rows: Sequence[ConditionRow], setting: str, key: str) -> None:
    """Raise ValueError naming the row, the image and the fix unless every row of `rows` follows
    `rule`: the count, the aspect ratio, and one encoded condition size for all rows. `setting`
    names where the rows come from (e.g. "data.train_files"); `key` the row field holding the
    images (`data.image_key`)."""
    first: tuple[str, tuple[tuple[int, int], ...]] | None = None
    for where, images in rows:
        if not rule.min_images <= len(images) <= rule.max_images:
            raise ValueError(
                f"{where}: the row has {len(images)} condition image(s) in {key!r}, and {rule.family} takes "
                f"{rule.count_text()} per prompt: give each row of {setting} {rule.count_text()} image(s) "
                f'(e.g. "{key}": "images/source.png"{", or a list" if rule.max_images > 1 else ""}), or set '
                "data.image_key to the field that holds them"
            )
        for name, width, height in images:
            aspect = max(width / height, height / width)
            if aspect > rule.max_aspect:
                raise ValueError(
                    f"{where}: condition image {name} is {width}x{height} (aspect ratio {aspect:.3g}:1); "
                    f"{rule.family} takes at most {rule.max_aspect:.3g}:1 ({rule.aspect_reason}): crop it"
                )
        sizes = tuple(rule.encoded_size(width, height) for _, width, height in images)
        if first is None:
            first = (where, sizes)
        elif sizes != first[1]:
            raise ValueError(
                f"{where}: {rule.family} encodes this row's condition image(s) at {_sizes(sizes)} pixels, but "
                f"{first[0]}'s at {_sizes(first[1])}: diffrl samples and trains a step's prompts in batches, "
                f"which need one condition size (and count) for every row of {setting}. Give all images "
                "the same aspect ratio (crop or pad them) and every row the same number of images, or "
                "split the file by aspect ratio into separate runs"
            )


def _sizes(sizes: Sequence[tuple[int, int]]) -> str:
    return " + ".join(f"{w}x{h}" for w, h in sizes)


# ------------------------------------------------------------------------------ family sizes
def qwen_edit_dimensions(target_area: int, width: int, height: int) -> tuple[int, int]:
    """diffusers' `calculate_dimensions` of the Qwen-Image-Edit pipelines: (width, height) of about
    `target_area` pixels at the image's aspect ratio, each a multiple of 32."""
    ratio = width / height
    w = math.sqrt(target_area * ratio)
    h = w / ratio
    return round(w / 32) * 32, round(h / 32) * 32


#: FLUX.1 Kontext's trained resolutions (width, height): diffusers' PREFERRED_KONTEXT_RESOLUTIONS.
KONTEXT_RESOLUTIONS = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


def kontext_size(width: int, height: int, multiple_of: int = 16, auto_resize: bool = True) -> tuple[int, int]:
    """(width, height) `FluxKontextPipeline` encodes a condition image of this size at: the sides
    rounded down to `multiple_of` (its image processor's `get_default_height_width`); with its
    `_auto_resize` (the default) then the trained resolution of the nearest aspect ratio, rounded
    down to `multiple_of` again."""
    width, height = width - width % multiple_of, height - height % multiple_of
    if auto_resize:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return width // multiple_of * multiple_of, height // multiple_of * multiple_of


__all__ = [
    "KONTEXT_RESOLUTIONS",
    "ConditionRow",
    "ConditionRule",
    "check_condition_rows",
    "kontext_size",
    "qwen_edit_dimensions",
]
