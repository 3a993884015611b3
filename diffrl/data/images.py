"""Dataset images: training images for supervised flow matching (read from files, or rendered
shapes-world scenes) and the condition images of image-edit prompt rows.

`load_image_rows` is a plain function of picklable arguments so that `diffrl sft` can run it in
worker processes (`sft.data_workers`), a few steps ahead of training: rendering or decoding
images on the training process would leave a fast GPU idle most of the time.

`ConditionImage` is one condition image of a prompt row (an edit model's source image): a file
path or the encoded bytes from a parquet cell, checked when the prompt file loads
(`read_condition_image`: the file exists, decodes, and its size is within the limits below) and
opened again by the sampler when it encodes the row. It carries its size, so the family's rules
(count, aspect ratio, one condition size per run: `diffrl.models.conditions`) are checked before
any model loads.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diffrl.files import open_regular

#: `sft.images` values whose training images are drawn from the rows instead of read from files,
#: registered by the task that defines such rows (`register_drawn_images`; the shapes world's
#: "shapes" and "shapes_edit", diffrl/toy/__init__.py): name -> draw(row, size, seed), a uint8
#: [size, size, 3] image, or [2, size, size, 3] (the target, then its condition image) for an edit task.
DRAWN_IMAGES: dict[str, Callable[[Any, int, int], np.ndarray]] = {}


def register_drawn_images(name: str, draw: Callable[[Any, int, int], np.ndarray]) -> None:
    """`sft.images=<name>` draws each row's image with `draw(row, size, seed)` (see DRAWN_IMAGES)."""
    if name in DRAWN_IMAGES and DRAWN_IMAGES[name] is not draw:
        raise ValueError(f"sft.images={name!r} is already drawn by {DRAWN_IMAGES[name]!r}; pick another name")
    DRAWN_IMAGES[name] = draw


#: Most pixels a condition image may have. The edit pipelines resize every condition image to about
#: one megapixel (Qwen-Image-Edit: 1024² for the VAE; FLUX.1 Kontext: its preferred resolutions), so
#: a larger one only costs decoding time and memory on every worker that encodes it.
MAX_CONDITION_PIXELS = 4096 * 4096
#: Shortest side a condition image may have, in pixels: the VAE (8x) and the 2x2 packing make 16
#: pixels one token; a smaller image carries nothing the model can encode (usually a broken file).
MIN_CONDITION_SIDE = 16
#: Largest condition image file (or parquet cell), in bytes.
MAX_CONDITION_BYTES = 64 << 20


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


@dataclass(frozen=True)
class ConditionImage:
    """One condition image of a prompt row: a file (`path`, absolute) or encoded bytes (`data`, a
    parquet cell), with the size it decoded to when the prompt file was loaded. `key` identifies
    the image for the sampler's encoding cache (the path, or a digest of the bytes)."""

    name: str  # how error messages name it: the path as written in the row, or "<column> bytes"
    width: int
    height: int
    path: str | None = None
    data: bytes | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        if self.path is not None:
            return f"file:{self.path}"
        return "sha256:" + hashlib.sha256(self.data or b"").hexdigest()

    def load(self):
        """The image as a Pillow RGB image, fully decoded (the sampler encodes it with the model)."""
        source = Path(self.path) if self.path is not None else io.BytesIO(self.data or b"")
        with _opened(source, f"condition image {self.name}") as image:
            if image.size != (self.width, self.height):
                raise ValueError(
                    f"condition image {self.name} is now {image.size[0]}x{image.size[1]}, but it was "
                    f"{self.width}x{self.height} when the prompt file loaded: the file changed during the run"
                )
            return _decoded(image, f"condition image {self.name}").convert("RGB")


def read_condition_image(value: Any, base_dir: Path, where: str, key: str) -> ConditionImage:
    """A condition image from a prompt row's `key` field: a path (relative to the prompt file's
    folder `base_dir`, or absolute), bytes (a parquet binary cell), or a dict with "bytes" and/or
    "path" (how Hugging Face datasets store an Image column). Checked now: it exists, decodes, and
    has at least `MIN_CONDITION_SIDE` pixels a side and at most `MAX_CONDITION_PIXELS` pixels.
    Every failure is a ValueError (FileNotFoundError for a missing file) naming `where` (the row),
    the image and the fix."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"bytes", "path"})
        if unknown or not (value.get("bytes") or value.get("path")):
            raise ValueError(
                f"{where}: {key!r} is an object with keys {sorted(value)}; a condition image is a path, "
                'bytes, or an object {"bytes": ..., "path": ...} (a Hugging Face Image column) with one of them set'
            )
        value = value["bytes"] if value.get("bytes") else value["path"]
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        name = f"{key!r} bytes ({len(data)} bytes)"
        if len(data) > MAX_CONDITION_BYTES:
            raise ValueError(
                f"{where}: condition image {name} is larger than {MAX_CONDITION_BYTES >> 20} MiB "
                "(diffrl.data.images.MAX_CONDITION_BYTES): store a smaller image (edit models resize it "
                "to about one megapixel anyway)"
            )
        with _opened(io.BytesIO(data), f"{where}: condition image {name}") as image:
            _check_condition_size(image, where, name)
            _decoded(image, f"{where}: condition image {name}")
            return ConditionImage(name, image.size[0], image.size[1], data=data)
    if not isinstance(value, str) or not value.strip():
        got = "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
        raise ValueError(
            f"{where}: {key!r} must be a condition image (a path relative to the prompt file, or bytes in a "
            f"parquet column), or a list of them; got {got}"
        )
    path = Path(value)
    path = path if path.is_absolute() else base_dir / path
    if not path.exists():
        raise FileNotFoundError(
            f"{where}: condition image {value!r} not found (looked for {path}); paths are relative to "
            "the prompt file's folder: fix the path or add the image"
        )
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_CONDITION_BYTES:
        raise ValueError(
            f"{where}: condition image {value!r} is {size >> 20} MiB, more than {MAX_CONDITION_BYTES >> 20} "
            "MiB (diffrl.data.images.MAX_CONDITION_BYTES): resize it (edit models encode about one megapixel)"
        )
    with _opened(path, f"{where}: condition image") as image:
        _check_condition_size(image, where, repr(value))
        _decoded(image, f"{where}: condition image {path}")
        return ConditionImage(value, image.size[0], image.size[1], path=str(path.resolve()))


def _check_condition_size(image: Any, where: str, name: str) -> None:
    width, height = image.size
    if width * height > MAX_CONDITION_PIXELS:
        raise ValueError(
            f"{where}: condition image {name} is {width}x{height}, more than {MAX_CONDITION_PIXELS:,} pixels "
            "(diffrl.data.images.MAX_CONDITION_PIXELS; edit models resize it to about one megapixel): "
            "downscale it"
        )
    if min(width, height) < MIN_CONDITION_SIDE:
        raise ValueError(
            f"{where}: condition image {name} is {width}x{height}; a side shorter than {MIN_CONDITION_SIDE} "
            "pixels (diffrl.data.images.MIN_CONDITION_SIDE) holds nothing an edit model can encode: "
            "use the full-size image"
        )


@contextmanager
def _opened(source: Path | io.BytesIO, what: str) -> Iterator[Any]:
    """`open_image` for a path or in-memory bytes (headers read; `_decoded` reads the pixels)."""
    if isinstance(source, Path):
        with open_image(source, what) as image:
            yield image
        return
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(source)
    except (UnidentifiedImageError, Image.DecompressionBombError):
        raise ValueError(
            f"{what} is not an image Pillow can read (PNG, JPEG, WebP, ...): store the encoded image "
            "file's bytes, or remove the row"
        ) from None
    with image:
        yield image


def _decoded(image: Any, what: str) -> Any:
    """`image` with its pixels read; a truncated or corrupt file is a ValueError naming `what`."""
    try:
        image.load()
    except (OSError, SyntaxError) as err:  # truncated or corrupt pixel data
        raise ValueError(f"{what} does not decode ({err}): replace the file, or remove the row") from None
    return image


def load_image_rows(
    source: str, rows: Sequence[dict | str], height: int, width: int, seeds: Sequence[int]
) -> np.ndarray:
    """uint8 [N, H, W, 3]. A `source` of DRAWN_IMAGES draws each row from its seed (the shapes
    world's "shapes": rows are scene dicts; "shapes_edit": edit dicts, the result [N, 2, H, W, 3]: the
    target, then the condition image); otherwise rows are image paths, checked to be H x W."""
    draw = DRAWN_IMAGES.get(source)
    images = []
    for row, seed in zip(rows, seeds, strict=True):
        if draw is not None:
            images.append(draw(row, height, seed))
        else:
            with open_image(Path(row), "image") as image:
                if image.size != (width, height):
                    raise ValueError(
                        f"{row} is {image.size[0]}x{image.size[1]} but training runs at {width}x{height} "
                        "(rollout.pipeline.width x height): resize the dataset's images, or change the size"
                    )
                images.append(np.array(image.convert("RGB")))
    return np.stack(images)


__all__ = [
    "DRAWN_IMAGES",
    "ConditionImage",
    "load_image_rows",
    "open_image",
    "read_condition_image",
    "register_drawn_images",
]
