"""The one contract every reward follows, and the helpers that enforce it.

A reward is a callable

    reward(pixels, prompts, metadata) -> RewardOutput

- `pixels`: uint8 tensor, images `[B, 3, H, W]` or videos `[B, T, 3, H, W]` (RGB, 0..255), the
  sampler's decoded output. Rewards never see latents, so any reward works with any model family.
- `prompts`: B strings, the prompt of each sample.
- `metadata`: B dicts, the per-sample fields of the prompt's dataset row (an OCR target text, a
  shapes spec, ...). Rewards read the keys they document and ignore the rest.
- `RewardOutput.scores_B`: float32 `(B,)`, higher is better; `extras`: named per-sample tensors
  with a leading dimension B (an OCR edit distance, ...), logged alongside the scores.

Image-edit runs also have each sample's source: the condition image(s) of its prompt row (the
prompt is then the edit instruction). A reward whose call takes a keyword parameter named
`sources` gets them (`takes_sources`):

    reward(pixels, prompts, metadata, *, sources) -> RewardOutput

- `sources`: B tuples, each the sample's condition images in row order as uint8 `[3, H', W']`
  tensors at their own size (which may differ from the result's), or None when the run's
  prompts carry no condition images (a text-to-image model). The samples of one prompt share the
  very same tensors: read them, never write them.

Every other reward is called as before, and the source images are not even decoded for it.
Callers hand `call_reward` the rows as `ConditionImage`s (diffrl.data.images: a path or the
encoded bytes, cheap to send to a reward worker) or tensors; `decode_sources` turns them into
tensors in the scoring process, each distinct image once.

Rewards that only need to look at single images subclass `ImageReward` and implement
`score_images` on `[N, 3, H, W]` frames; videos are then scored frame by frame and each sample's
score is the mean over its frames, so every image reward also works on video.

Video rewards may look at a few frames only (`reward.functions.<name>.video_frames=K`):
`call_reward` then hands the reward K evenly spaced frames of each video (`frame_indices`: the
first and the last always among them), so an image reward's score is the mean over those K.

User functions may be sloppier than built-ins: `as_reward_output` accepts a `RewardOutput`, a
tensor, a NumPy array or a list of floats, and `resolve_awaitable` runs `async def` rewards, so the
caller (`MultiReward`, the HTTP server) always gets a checked `RewardOutput`.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from PIL import Image

from diffrl.lazy import lazy_import

torch = lazy_import("torch")  # deferred: see diffrl.lazy


@dataclass
class RewardOutput:
    """What a reward returns for a batch of B samples.

    scores_B: float32 (B,) on the CPU, higher is better; finite.
    extras:   name -> tensor with leading dimension B (per-sample diagnostics, logged, not optimised).
    """

    scores_B: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.scores_B.shape[0])


@runtime_checkable
class Reward(Protocol):
    """Anything callable as `reward(pixels, prompts, metadata) -> RewardOutput`."""

    def __call__(
        self, pixels: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput: ...


def check_batch(
    pixels: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None,
) -> list[dict[str, Any]]:
    """Validate one batch against the contract; returns the metadata as a list of B dicts.

    `metadata=None` is accepted as "no metadata" (B empty dicts), for callers without a dataset.
    """
    if not isinstance(pixels, torch.Tensor):
        raise ValueError(f"pixels must be a torch.Tensor, got {type(pixels).__name__}")
    if pixels.dtype != torch.uint8:
        raise ValueError(
            f"pixels must be uint8 (0..255), got dtype {pixels.dtype}; convert with "
            "(x.clamp(0, 1) * 255).round().to(torch.uint8)"
        )
    is_image = pixels.ndim == 4 and pixels.shape[1] == 3
    is_video = pixels.ndim == 5 and pixels.shape[2] == 3
    if not (is_image or is_video):
        raise ValueError(
            f"pixels must have shape [B, 3, H, W] (images) or [B, T, 3, H, W] (videos), got {tuple(pixels.shape)}"
        )
    batch = pixels.shape[0]
    if batch == 0:
        raise ValueError("pixels holds no samples (B = 0)")
    if isinstance(prompts, str) or len(prompts) != batch:
        raise ValueError(f"prompts must be a list of B={batch} strings, got {prompts!r:.200}")
    if metadata is None:
        return [{} for _ in range(batch)]
    if len(metadata) != batch:
        raise ValueError(f"metadata must be a list of B={batch} dicts, got {len(metadata)} entries")
    for i, row in enumerate(metadata):
        if not isinstance(row, Mapping):
            raise ValueError(f"metadata[{i}] must be a dict, got {type(row).__name__}: {row!r:.200}")
    return [dict(row) for row in metadata]


def as_reward_output(result: Any, batch_size: int, name: str) -> RewardOutput:
    """Normalise what a reward returned to a checked `RewardOutput` (float32, CPU, shape (B,)).

    Accepts a `RewardOutput`, or bare scores as a tensor / NumPy array / sequence of numbers.
    Raises ValueError naming the reward when the shape is wrong or a score is not finite (a NaN
    reward would silently poison every advantage of its group).
    """
    if isinstance(result, RewardOutput):
        scores, extras = result.scores_B, result.extras
    else:
        scores, extras = result, {}
    try:
        scores_B = torch.as_tensor(np.asarray(scores) if not isinstance(scores, torch.Tensor) else scores)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"reward {name!r} returned {type(result).__name__}, which is not scores: return a RewardOutput, "
            f"a tensor, or a list of {batch_size} floats"
        ) from err
    scores_B = scores_B.detach().to("cpu", torch.float32).contiguous()
    if tuple(scores_B.shape) != (batch_size,):
        raise ValueError(
            f"reward {name!r} returned scores of shape {tuple(scores_B.shape)}; expected ({batch_size},), "
            "one score per sample"
        )
    bad = (~torch.isfinite(scores_B)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"reward {name!r} returned non-finite scores for samples {bad[:10]} "
            f"(values {scores_B[bad[:10]].tolist()})"
        )
    checked: dict[str, torch.Tensor] = {}
    for key, value in extras.items():
        tensor = torch.as_tensor(value).detach().cpu()
        if tensor.ndim == 0 or tensor.shape[0] != batch_size:
            raise ValueError(
                f"reward {name!r} extra {key!r} has shape {tuple(tensor.shape)}; extras need a leading "
                f"dimension B={batch_size}"
            )
        checked[str(key)] = tensor
    return RewardOutput(scores_B, checked)


def resolve_awaitable(result: Any) -> Any:
    """Run `result` to completion if it is awaitable (an `async def` reward); else return it.

    Reward calls are synchronous in diffrl. When this thread already runs an event loop (a reward
    called from async code), the coroutine runs on a fresh loop in a helper thread, since
    `asyncio.run` cannot nest.
    """
    if not inspect.isawaitable(result):
        return result

    async def _await() -> Any:
        return await result

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await())
    box: dict[str, Any] = {}

    def _runner() -> None:
        try:
            box["value"] = asyncio.run(_await())
        except BaseException as err:  # re-raised in the calling thread below
            box["error"] = err

    thread = threading.Thread(target=_runner, name="diffrl-async-reward")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_reward(
    reward: Reward,
    pixels: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    name: str,
    video_frames: int | None = None,
    sources: Sequence[Sequence[Any]] | None = None,
) -> RewardOutput:
    """Call any reward (sync or async, strict or sloppy output) and return a checked output.

    video_frames: for videos, the reward sees only that many evenly spaced frames of each sample
    (`select_frames`); None = every frame. Images are passed as they are.
    sources: each sample's condition images (module docstring), given to the reward as the
    keyword `sources` only when it takes them (`takes_sources`; then None when there are none).
    """
    pixels = select_frames(pixels, video_frames)
    if takes_sources(reward):
        rows = None if sources is None else decode_sources(sources, int(pixels.shape[0]))
        result = reward(pixels, list(prompts), list(metadata), sources=rows)
    else:
        result = reward(pixels, list(prompts), list(metadata))
    return as_reward_output(resolve_awaitable(result), int(pixels.shape[0]), name)


# ------------------------------------------------------------------------------ source images
#: The keyword through which a reward receives each sample's source (condition) images.
SOURCES_PARAM = "sources"

SourceRows = list[tuple["torch.Tensor", ...]]


def takes_sources(reward: Any) -> bool:
    """Whether `reward` is called with `sources=` (module docstring): its `takes_sources`
    attribute when it has one (wrappers such as the `python` reward declare their target's), else
    whether its call signature has a parameter named `sources`."""
    declared = getattr(reward, "takes_sources", None)
    if isinstance(declared, bool):
        return declared
    try:
        params = inspect.signature(reward).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    param = params.get(SOURCES_PARAM)
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def needs_sources(reward: Any) -> bool:
    """Whether `reward` cannot score without sources: its `sources` parameter has no default."""
    if not takes_sources(reward):
        return False
    declared = getattr(reward, "needs_sources", None)
    if isinstance(declared, bool):
        return declared
    try:
        param = inspect.signature(reward).parameters.get(SOURCES_PARAM)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def decode_sources(
    rows: Sequence[Sequence[Any]], batch: int, cache: dict[Any, torch.Tensor] | None = None
) -> SourceRows:
    """B rows of source images as uint8 `[3, H, W]` tensors, each distinct image decoded once.

    An item is a tensor (checked, passed as it is) or a `ConditionImage` (diffrl.data.images:
    decoded with its `load()`, keyed by its file or bytes digest). `cache` (key -> tensor), when
    given, is read and filled, so a caller scoring consecutive micro-batches of the same prompts
    decodes each image once. Raises ValueError naming the sample and the item when a row is not
    one of these.
    """
    if isinstance(rows, str | bytes) or len(rows) != batch:
        raise ValueError(f"sources must be B={batch} rows (one per sample), got {_count(rows)}")
    cache = {} if cache is None else cache
    out: SourceRows = []
    for i, row in enumerate(rows):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence):
            raise ValueError(
                f"sources[{i}] must be a tuple of the sample's source images, got {type(row).__name__}"
            )
        out.append(tuple(_source_tensor(item, cache, f"sources[{i}][{j}]") for j, item in enumerate(row)))
    return out


def _count(rows: Any) -> str:
    try:
        return f"{len(rows)} rows"
    except TypeError:
        return type(rows).__name__


def _source_tensor(item: Any, cache: dict[Any, torch.Tensor], where: str) -> torch.Tensor:
    if isinstance(item, torch.Tensor):
        if item.dtype != torch.uint8 or item.ndim != 3 or item.shape[0] != 3:
            raise ValueError(
                f"{where} must be a uint8 [3, H, W] RGB image, got {item.dtype} of shape {tuple(item.shape)}"
            )
        return item
    key = getattr(item, "key", None)
    if key is None or not callable(getattr(item, "load", None)):
        raise ValueError(
            f"{where} must be a uint8 [3, H, W] tensor or a ConditionImage (diffrl.data.images), got "
            f"{type(item).__name__}"
        )
    if key not in cache:
        array_HW3 = np.asarray(item.load().convert("RGB"))
        cache[key] = torch.from_numpy(array_HW3.transpose(2, 0, 1).copy())
    return cache[key]


# ------------------------------------------------------------------------------ frames / images
def flatten_frames(pixels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`[B,3,H,W]` -> (itself, T=1); `[B,T,3,H,W]` -> (`[B*T,3,H,W]`, T), sample-major."""
    if pixels.ndim == 4:
        return pixels, 1
    batch, frames = pixels.shape[:2]
    return pixels.reshape(batch * frames, *pixels.shape[2:]), frames


def check_video_frames(video_frames: Any, at: str) -> int | None:
    """`video_frames` as the int it must be (>= 2: the first and the last frame), or None; `at`
    names the setting in the error."""
    if video_frames is None:
        return None
    if isinstance(video_frames, bool) or not isinstance(video_frames, int) or video_frames < 2:
        raise ValueError(
            f"{at}={video_frames!r} is invalid: must be an integer >= 2 (frames scored per video, the "
            "first and the last among them) or null to score every frame"
        )
    return video_frames


def frame_indices(num_frames: int, video_frames: int | None) -> list[int]:
    """Which frames of a `num_frames`-frame video are scored: K = `video_frames` evenly spaced ones,

        i_k = round(k · (T − 1) / (K − 1)),   k = 0 .. K − 1   (halves round up)

    so i_0 = 0 and i_{K-1} = T − 1; distinct, since the spacing (T − 1)/(K − 1) is >= 1 when K <= T.
    Every frame when `video_frames` is None or >= T.
    """
    if video_frames is None or video_frames >= num_frames:
        return list(range(num_frames))
    steps = video_frames - 1
    # integer arithmetic: float rounding must not move a frame by one at exact halves
    return [(2 * k * (num_frames - 1) + steps) // (2 * steps) for k in range(video_frames)]


def select_frames(pixels: torch.Tensor, video_frames: int | None) -> torch.Tensor:
    """Videos `[B, T, 3, H, W]` -> `[B, K, 3, H, W]`, the frames `frame_indices(T, K)`; images and
    `video_frames=None` pass through unchanged."""
    if video_frames is None or pixels.ndim != 5:
        return pixels
    index = frame_indices(int(pixels.shape[1]), video_frames)
    if len(index) == pixels.shape[1]:
        return pixels
    return pixels[:, index]


def mean_over_frames(values_N: torch.Tensor, frames: int) -> torch.Tensor:
    """Average a per-frame `(B*T, ...)` tensor over each sample's T frames -> `(B, ...)` float32."""
    if frames == 1:
        return values_N
    return values_N.reshape(-1, frames, *values_N.shape[1:]).to(torch.float32).mean(dim=1)


def to_pil(frames_N3HW: torch.Tensor) -> list[Image.Image]:
    """uint8 `[N,3,H,W]` -> N RGB PIL images (for Pillow, Tesseract and CLIP preprocessing)."""
    array_NHW3 = frames_N3HW.detach().to("cpu").permute(0, 2, 3, 1).contiguous().numpy()
    return [Image.fromarray(frame, mode="RGB") for frame in array_NHW3]


class ImageReward:
    """Base class of rewards that judge one image at a time.

    Subclasses implement `score_images(frames_N3HW, prompts_N, metadata_N) -> RewardOutput`.
    `__call__` checks the batch, flattens videos to frames (each frame gets its sample's prompt and
    metadata), and averages scores and float extras over each sample's frames.
    """

    name: str = "image_reward"

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        raise NotImplementedError

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardOutput:
        rows = check_batch(pixels, prompts, metadata)
        frames_N3HW, frames = flatten_frames(pixels)
        prompts_N = [p for p in prompts for _ in range(frames)]
        metadata_N = [row for row in rows for _ in range(frames)]
        out = as_reward_output(
            self.score_images(frames_N3HW, prompts_N, metadata_N), frames_N3HW.shape[0], self.name
        )
        if frames == 1:
            return out
        extras = {key: mean_over_frames(value, frames) for key, value in out.extras.items()}
        return RewardOutput(mean_over_frames(out.scores_B, frames), extras)


def auto_device(device: str) -> torch.device:
    """`"auto"` -> the GPU when one is visible (a Ray reward worker with num_gpus > 0), else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"device={device!r} is not a torch device: use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from err


def auto_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`"auto"` -> bfloat16 on a GPU, float32 on the CPU; else the named torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"dtype={dtype!r} is invalid: must be 'auto' or one of {', '.join(choices)}")
    return choices[dtype]
