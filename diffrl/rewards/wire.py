"""The reward scorers' wire format: JSON with lossless base64 PNGs, never pickle, so a server can
be written in any language and a malicious peer cannot run code in the trainer. The `http` reward
(`diffrl.rewards.remote`) encodes requests and decodes answers with it; `diffrl serve-reward`
(`diffrl.rewards.server`) the other way round.

Protocol (version 1):

    POST <url>/score
      {"version": 1,
       "images": ["<base64 PNG>", ...]            # B images, or
       "videos": [["<base64 PNG>", ...], ...],    # B videos of T frames (exactly one of the two)
       "prompts": ["...", ...],                   # B strings (in an edit run: the instructions)
       "metadata": [{...}, ...],                  # B JSON objects
       "source_images": ["<base64 PNG>", ...],    # optional (edit runs): the batch's distinct
       "sources": [[0], [0], [1], ...]}           #   source images, each once, and per sample the
                                                  #   indices of its own, in row order
    200 -> {"scores": [float x B], "extras": {"name": [per-sample values, B long]}}
    4xx/5xx -> {"error": "message"}
    GET <url>/health -> {"status": "ok", "reward": "<spec>", "version": 1, "sources": true|false}

The two source fields are additive: a server whose reward reads source images (`takes_sources`)
says `"sources": true` in /health, and the client sends them only to such a server (a server
without the key, an older one, never gets them), so the requests of non-edit scorers are
unchanged. Source images count toward the server's image and pixel limits; they may have another
size than the results (each its own).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from diffrl.lazy import lazy_import
from diffrl.rewards.base import RewardOutput, as_reward_output, check_batch, decode_sources

torch = lazy_import("torch")  # deferred: see diffrl.lazy

PROTOCOL_VERSION = 1
IMAGE_FORMATS = ("PNG", "JPEG")  # the only decoders a request may reach (PNG is what clients send)


class LimitExceeded(ValueError):
    """A request is over one of the server's limits: `limit` names it (the CLI flag), `value` is its value."""

    def __init__(self, limit: str, value: int | float, message: str, status: int = 413) -> None:
        super().__init__(f"{message} (limit {limit}={value})")
        self.limit, self.value, self.status = limit, value, status


def encode_png(frame_3HW: torch.Tensor) -> str:
    """uint8 [3,H,W] -> base64 PNG (lossless, so the server scores exactly the sampled pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(frame_3HW.permute(1, 2, 0).contiguous().numpy(), mode="RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> torch.Tensor:
    """base64 PNG -> uint8 [3,H,W] RGB."""
    image = _open_image(data)
    return _to_chw(image)


def pillow_pixel_cap() -> int:
    """The most pixels `Image.open` accepts: above it Pillow raises DecompressionBombError itself
    (twice `Image.MAX_IMAGE_PIXELS`, which only warns); None there disables its check."""
    cap = Image.MAX_IMAGE_PIXELS
    return 2 * int(cap) if cap is not None else 1 << 62


def _open_image(data: Any, index: int = 0, max_image_pixels: int | None = None) -> Image.Image:
    """A PIL image from base64 with only its header read (the size is known, no pixel decoded yet).

    Pillow's own decompression-bomb check runs in `Image.open`, before the caller can compare the
    size with its limit: an image it refuses is over `max_image_pixels` too (a server refuses a
    larger limit when it starts), so the answer names the caller's limit, never Pillow's number."""
    if not isinstance(data, str):
        raise ValueError(f"an image must be a base64 string, got {type(data).__name__}")
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True)), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as err:
        if max_image_pixels is None:
            raise ValueError(f"image {index} is too large to decode: {err}") from err
        raise LimitExceeded(
            "max_image_pixels", max_image_pixels, f"image {index} has more than {pillow_pixel_cap()} pixels"
        ) from err
    except Exception as err:
        raise ValueError(f"not a base64-encoded PNG or JPEG: {type(err).__name__}: {err}") from err


def _to_chw(image: Image.Image, out_3HW: torch.Tensor | None = None) -> torch.Tensor:
    """Decode the pixels (RGB) into `out_3HW` (or a new tensor)."""
    try:
        array_HW3 = np.asarray(image.convert("RGB"))
    except Exception as err:
        raise ValueError(f"image data is corrupt: {type(err).__name__}: {err}") from err
    if out_3HW is None:
        return torch.from_numpy(array_HW3.transpose(2, 0, 1).copy())
    out_3HW.numpy()[...] = array_HW3.transpose(2, 0, 1)  # through a view: no intermediate tensor
    return out_3HW


def encode_request(
    pixels: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    sources: Sequence[Sequence[torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The JSON body of POST /score for one batch (checked against the reward contract).

    `sources`: each sample's source images (uint8 [3, H, W]); each distinct tensor is encoded
    once into "source_images", and "sources" holds each sample's indices into it."""
    rows = check_batch(pixels, prompts, metadata)
    pixels = pixels.detach().cpu()
    body: dict[str, Any] = {"version": PROTOCOL_VERSION, "prompts": list(prompts), "metadata": rows}
    if pixels.ndim == 4:
        body["images"] = [encode_png(frame) for frame in pixels]
    else:
        body["videos"] = [[encode_png(frame) for frame in video] for video in pixels]
    if sources is not None:
        index: dict[int, int] = {}  # id(tensor) -> its place in source_images
        images: list[str] = []
        sample_rows = []
        for row in decode_sources(sources, int(pixels.shape[0])):
            for image in row:
                if id(image) not in index:
                    index[id(image)] = len(images)
                    images.append(encode_png(image.detach().cpu()))
            sample_rows.append([index[id(image)] for image in row])
        body["source_images"], body["sources"] = images, sample_rows
    return body


def _source_indices(body: dict[str, Any], batch: int) -> tuple[list[Any], list[list[int]]] | None:
    """("source_images", "sources") of a request, checked; None when it has neither."""
    if "sources" not in body and "source_images" not in body:
        return None
    images, rows = body.get("source_images"), body.get("sources")
    if not isinstance(images, list) or not isinstance(rows, list):
        raise ValueError(
            "'source_images' (a list of base64 PNGs) and 'sources' (one list of indices per sample) "
            "go together"
        )
    if len(rows) != batch:
        raise ValueError(
            f"'sources' has {len(rows)} rows for {batch} samples; one list of indices per sample"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(images) for k in row
        ):
            raise ValueError(
                f"'sources'[{i}] must be a list of indices into 'source_images' (0..{len(images) - 1}), "
                f"got {str(row)[:100]}"
            )
    return images, rows


def decode_request(
    body: Any,
    *,
    max_images: int | None = None,
    max_image_pixels: int | None = None,
    max_request_pixels: int | None = None,
    max_prompt_chars: int | None = None,
    with_sources: bool = True,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]], list[tuple[torch.Tensor, ...]] | None]:
    """(pixels, prompts, metadata, sources) from a POST /score body; ValueError says what is malformed.

    `sources` is None when the body has none, or when `with_sources` is False (a server whose
    reward reads no source images ignores them: not one is opened). Otherwise B tuples of uint8
    [3, H, W] tensors, the samples that name the same source image sharing its tensor.

    The limits (None = unbounded) are checked before any pixel is decoded: counts first, then each
    image's header (width x height), so a small PNG that claims 8000x8000 costs a few bytes, not
    192 MB; source images count like the results. `LimitExceeded` (a ValueError) names the limit;
    the server answers 413 with it. Frames are decoded one by one straight into the batch tensor
    (no per-frame copies kept).
    """
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ValueError(
            f"protocol version {body.get('version')!r} is not supported (this server: {PROTOCOL_VERSION})"
        )
    if ("images" in body) == ("videos" in body):
        raise ValueError("the request needs exactly one of 'images' (B PNGs) or 'videos' (B lists of PNGs)")
    prompts, metadata = body.get("prompts"), body.get("metadata")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list):
        raise ValueError("'metadata' must be a list of objects")
    if "images" in body:
        items = body["images"]
        if not isinstance(items, list) or not items:
            raise ValueError("'images' must be a non-empty list of base64 PNG strings")
        frames, lead = items, (len(items),)
    else:
        items = body["videos"]
        if not isinstance(items, list) or not items or not all(isinstance(v, list) and v for v in items):
            raise ValueError("'videos' must be a non-empty list of non-empty lists of base64 PNG strings")
        if len({len(v) for v in items}) != 1:
            raise ValueError("all videos of a request must have the same frame count and size")
        frames, lead = [frame for video in items for frame in video], (len(items), len(items[0]))
    if len(prompts) != lead[0] or len(metadata) != lead[0]:
        raise ValueError(
            f"{lead[0]} samples but {len(prompts)} prompts and {len(metadata)} metadata rows; one of each per sample"
        )
    given = _source_indices(body, lead[0]) if with_sources else None
    source_data = given[0] if given is not None else []
    if max_images is not None and len(frames) + len(source_data) > max_images:
        raise LimitExceeded(
            "max_images",
            max_images,
            f"{len(frames) + len(source_data)} images (video frames and source images count) in one request",
        )
    if max_prompt_chars is not None:
        longest = max((len(p) for p in prompts), default=0)
        if longest > max_prompt_chars:
            raise LimitExceeded("max_prompt_chars", max_prompt_chars, f"a prompt of {longest} characters")
    # Every header first (results, then source images), so the limits hold before any pixel decodes.
    opened = []
    total_pixels = 0
    for index, data in enumerate([*frames, *source_data]):
        what = f"image {index}" if index < len(frames) else f"source image {index - len(frames)}"
        image = _open_image(data, index, max_image_pixels)
        width, height = image.size
        if max_image_pixels is not None and width * height > max_image_pixels:
            raise LimitExceeded(
                "max_image_pixels", max_image_pixels, f"{what} is {width}x{height} = {width * height} pixels"
            )
        total_pixels += width * height
        if max_request_pixels is not None and total_pixels > max_request_pixels:
            raise LimitExceeded(
                "max_request_pixels",
                max_request_pixels,
                f"the images up to {what} hold {total_pixels} pixels (source images count)",
            )
        if index < len(frames) and opened and image.size != opened[0].size:
            raise ValueError(
                f"all images of a request must have the same size: image {index} is {width}x{height}, "
                f"image 0 is {opened[0].size[0]}x{opened[0].size[1]}"
            )
        opened.append(image)
    images, source_images = opened[: len(frames)], opened[len(frames) :]
    width, height = images[0].size
    pixels = torch.empty((len(images), 3, height, width), dtype=torch.uint8)
    for index, image in enumerate(images):
        _to_chw(image, pixels[index])
        images[index] = None  # type: ignore[call-overload]  # free the compressed bytes as we go
    pixels = pixels.reshape(*lead, 3, height, width)
    rows = check_batch(pixels, prompts, metadata)
    if given is None:
        return pixels, prompts, rows, None
    decoded = [_to_chw(image) for image in source_images]
    return pixels, prompts, rows, [tuple(decoded[k] for k in row) for row in given[1]]


def encode_response(output: RewardOutput) -> dict[str, Any]:
    """The JSON answer to POST /score."""
    return {
        "scores": output.scores_B.tolist(),
        "extras": {key: value.tolist() for key, value in output.extras.items()},
    }


def decode_response(body: Any, batch_size: int, name: str) -> RewardOutput:
    """A checked `RewardOutput` from a POST /score answer."""
    if not isinstance(body, dict) or "scores" not in body:
        raise ValueError(f"reward {name!r}: the server's answer has no 'scores': {str(body)[:200]}")
    extras = body.get("extras") or {}
    if not isinstance(extras, dict):
        raise ValueError(
            f"reward {name!r}: the server's 'extras' must be an object, got {type(extras).__name__}"
        )
    try:
        output = RewardOutput(
            torch.tensor(body["scores"], dtype=torch.float32),
            {key: torch.tensor(value) for key, value in extras.items()},
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward {name!r}: the server's answer is not numeric: {err}") from err
    return as_reward_output(output, batch_size, name)
