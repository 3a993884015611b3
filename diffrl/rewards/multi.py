"""Several rewards at once: a weighted sum, per-reward scores and metrics, and failure policy.

    total_B = sum_k weight_k * scores_k_B          over the entries of `reward.functions`

Failure policy, per entry (`reward.functions.<name>.required`):

- `required: true` (the default): an exception while scoring stops the run with `RewardError`
  naming the reward, the batch size and the cause (and how to make the reward optional).
- `required: false`: the reward scores 0 for every sample of the failed micro-batch, the failure is
  logged (a warning with the cause) and counted; the other rewards still count. Use this for a
  remote scorer that may hiccup, where losing one micro-batch's signal beats losing the run.

Metrics of a step (`RewardBatch.metrics(uids)`), in the scheme of `diffrl.algos.metrics`:

    rewards/{mean,max,min,zero_std_ratio,std_mean,group_size}           the weighted total
    rewards/<name>/{mean,max,min,zero_std_ratio,std_mean,group_size}    each reward, unweighted
    rewards/<name>/failed_batches      micro-batches on which <name> failed (scored 0)
    rewards/<name>/failed_fraction     fraction of the step's samples scored 0 that way
    rewards/<name>/seconds             wall time spent scoring with <name>, summed over micro-batches
    rewards/<name>/<extra>_mean        mean of each float extra (e.g. rewards/ocr/edit_distance_mean)

`<name>` is the entry's key made metric-safe (`http@ocr` -> `http_ocr`, see `metric_name`).

Edit runs pass each sample's source images (`sources`, diffrl.rewards.base); they are decoded
here, once per distinct image, only when a reward that reads them scores the batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffrl.algos.metrics import reward_metrics
from diffrl.lazy import lazy_import
from diffrl.rewards import base as reward_base
from diffrl.rewards.base import (
    Reward,
    call_reward,
    check_batch,
    check_video_frames,
    decode_sources,
    takes_sources,
)
from diffrl.rewards.registry import build_reward, check_reward_spec, metric_name

torch = lazy_import("torch")  # deferred: see diffrl.lazy

logger = logging.getLogger(__name__)


class RewardError(ValueError):
    """A required reward failed; the run cannot continue with a wrong reward signal.

    A ValueError, as bad input is: the message names the reward, what it returned or raised and
    the fix, and `diffrl train` ends with it (exit 2) instead of a traceback."""


def _raised_at(error: BaseException) -> str:
    """' (raised at FILE:LINE in FUNCTION)', the innermost frame of `error`: where a reward's own
    bug is, for a message without a traceback; '' when the code that checks what rewards return
    raised it (diffrl.rewards.base: a NaN, a wrong count), since the message says what it found."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or frames[-1].filename == reward_base.__file__:
        return ""
    return f" (raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})"


@dataclass(frozen=True)
class RewardSpec:
    """One entry of `reward.functions`: the reward's name (key), weight, policy, args and, for
    videos, how many evenly spaced frames it scores (None = all). `gpus` > 0: the reward has reward
    workers of its own (`workers` of them, each with that many GPUs; diffrl.workers.reward_workers),
    apart from the shared ones that score the other rewards."""

    name: str
    weight: float = 1.0
    required: bool = True
    args: Mapping[str, Any] = field(default_factory=dict)
    video_frames: int | None = None
    gpus: float = 0.0
    workers: int = 1


#: The keys of one `reward.functions` entry.
SPEC_KEYS = ("weight", "required", "args", "video_frames", "gpus", "workers")


def _check_own_workers(spec: RewardSpec) -> None:
    at = f"reward.functions.{spec.name}"
    if isinstance(spec.gpus, bool) or not isinstance(spec.gpus, int | float) or not 0 <= spec.gpus < math.inf:
        raise ValueError(
            f"{at}.gpus={spec.gpus!r} is invalid: GPUs for each of this reward's own workers, a number >= 0 "
            "(0: scored by the shared reward workers, reward.gpus_per_worker)"
        )
    if isinstance(spec.workers, bool) or not isinstance(spec.workers, int) or spec.workers < 1:
        raise ValueError(f"{at}.workers={spec.workers!r} is invalid: must be an integer >= 1")
    if spec.workers > 1 and spec.gpus == 0:
        raise ValueError(
            f"{at}.workers={spec.workers} applies to a reward with workers of its own: set {at}.gpus > 0 "
            "too, or use reward.workers for the shared reward workers"
        )


def reward_specs(functions: Mapping[str, Any]) -> list[RewardSpec]:
    """Specs from `RewardConfig.functions` (`RewardFnConfig` objects) or plain dicts with the same
    keys (`weight`, `required`, `args`); checks every name and args without loading any model."""
    if not functions:
        raise ValueError(
            "reward.functions is empty: name at least one reward, e.g. reward.functions.jpeg_compressibility.weight=1 "
            "(docs/rewards.md lists them)"
        )
    specs = []
    for name, entry in functions.items():
        if isinstance(entry, RewardSpec):
            spec = entry
        elif isinstance(entry, Mapping):
            unknown = set(entry) - set(SPEC_KEYS)
            if unknown:
                raise ValueError(
                    f"reward.functions.{name} has unknown key(s) {sorted(unknown)}: use {', '.join(SPEC_KEYS)}"
                )
            spec = RewardSpec(
                str(name),
                float(entry.get("weight", 1.0)),
                bool(entry.get("required", True)),
                dict(entry.get("args") or {}),
                entry.get("video_frames"),
                entry.get("gpus", 0.0),
                entry.get("workers", 1),
            )
        else:
            spec = RewardSpec(
                str(name),
                float(entry.weight),
                bool(entry.required),
                dict(entry.args),
                entry.video_frames,
                getattr(entry, "gpus", 0.0),
                getattr(entry, "workers", 1),
            )
        check_video_frames(spec.video_frames, f"reward.functions.{name}.video_frames")
        _check_own_workers(spec)
        if not math.isfinite(spec.weight):
            raise ValueError(
                f"reward.functions.{name}.weight={spec.weight!r} is invalid: must be a finite number"
            )
        check_reward_spec(spec.name, spec.args)
        specs.append(spec)
    metric_names = [metric_name(s.name) for s in specs]
    for i, m in enumerate(metric_names):
        if m in metric_names[:i]:
            raise ValueError(
                f"rewards {specs[metric_names.index(m)].name!r} and {specs[i].name!r} would log under the same "
                f"metric name rewards/{m}/...; rename one (NAME@LABEL)"
            )
    return specs


@dataclass
class RewardBatch:
    """The rewards of B samples (one micro-batch, or a whole step after `concat`).

    total_B:        float32 (B,) weighted sum, what advantages are computed from.
    scores:         name -> float32 (B,) unweighted score of each reward (0 where it failed).
    extras:         "<name>/<extra>" -> (B, ...) per-sample extras (NaN where the reward failed).
    failed:         name -> bool (B,), True where the reward failed and scored 0.
    failed_batches: name -> number of micro-batches on which it failed.
    seconds:        name -> wall seconds spent in the reward.
    """

    total_B: torch.Tensor
    scores: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor]
    failed: dict[str, torch.Tensor]
    failed_batches: dict[str, int]
    seconds: dict[str, float]

    def __len__(self) -> int:
        return int(self.total_B.shape[0])

    def select(self, index: slice) -> RewardBatch:
        """The samples at `index` (per-sample fields sliced; counters and timings kept whole)."""
        return dataclasses.replace(
            self,
            total_B=self.total_B[index],
            scores={k: v[index] for k, v in self.scores.items()},
            extras={k: v[index] for k, v in self.extras.items()},
            failed={k: v[index] for k, v in self.failed.items()},
        )

    @staticmethod
    def concat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """Join micro-batches in order (sample order is preserved)."""
        if not batches:
            raise ValueError("RewardBatch.concat needs at least one batch")
        names = list(batches[0].scores)
        extras: dict[str, torch.Tensor] = {}
        for key in dict.fromkeys(k for b in batches for k in b.extras):
            like = next(b.extras[key] for b in batches if key in b.extras)
            parts = [
                b.extras[key] if key in b.extras else torch.full((len(b), *like.shape[1:]), math.nan)
                for b in batches
            ]
            if any(p.is_floating_point() for p in parts):
                parts = [p.float() for p in parts]
            extras[key] = torch.cat(parts)
        return RewardBatch(
            total_B=torch.cat([b.total_B for b in batches]),
            scores={n: torch.cat([b.scores[n] for b in batches]) for n in names},
            extras=extras,
            failed={n: torch.cat([b.failed[n] for b in batches]) for n in names},
            failed_batches={n: sum(b.failed_batches[n] for b in batches) for n in names},
            seconds={n: sum(b.seconds[n] for b in batches) for n in names},
        )

    @staticmethod
    def merge(parts: Sequence[RewardBatch], specs: Sequence[RewardSpec]) -> RewardBatch:
        """One micro-batch scored by several reward workers, each for some of `specs`' rewards
        (diffrl.workers.reward_workers: a reward with GPUs of its own): every reward's fields as
        its part has them, in `specs` order, and the total recomputed as `MultiReward` computes it
        (Σ weight × score in `specs` order, a failed reward adding nothing), so bitwise the total
        of one `MultiReward` scoring them all."""
        by_name = {name: part for part in parts for name in part.scores}
        missing = [spec.name for spec in specs if spec.name not in by_name]
        if missing or len(by_name) != len(specs):
            raise ValueError(
                f"RewardBatch.merge: the parts score {sorted(by_name)}, the specs name "
                f"{[spec.name for spec in specs]}"
            )
        total_B = torch.zeros(len(parts[0]), dtype=torch.float32)
        for spec in specs:
            part = by_name[spec.name]
            if not bool(part.failed[spec.name].any()):
                total_B += spec.weight * part.scores[spec.name]
        names = [spec.name for spec in specs]
        return RewardBatch(
            total_B=total_B,
            scores={n: by_name[n].scores[n] for n in names},
            extras={
                key: value
                for n in names
                for key, value in by_name[n].extras.items()
                if key.partition("/")[0] == n
            },
            failed={n: by_name[n].failed[n] for n in names},
            failed_batches={n: by_name[n].failed_batches[n] for n in names},
            seconds={n: by_name[n].seconds[n] for n in names},
        )

    def metrics(self, uids: Sequence[Hashable] | np.ndarray | torch.Tensor) -> dict[str, float]:
        """This batch's reward metrics (names in the module docstring); `uids` group the samples by prompt."""
        out = reward_metrics(self.total_B, uids)
        for name, scores_B in self.scores.items():
            prefix = f"rewards/{metric_name(name)}"
            out.update(reward_metrics(scores_B, uids, prefix=prefix))
            out[f"{prefix}/failed_batches"] = float(self.failed_batches[name])
            out[f"{prefix}/failed_fraction"] = self.failed[name].double().mean().item()
            out[f"{prefix}/seconds"] = float(self.seconds[name])
        for key, value in self.extras.items():
            if value.is_floating_point():
                name, _, extra = key.partition("/")
                out[f"rewards/{metric_name(name)}/{extra}_mean"] = value.double().nanmean().item()
        return out


class MultiReward:
    """Every reward of `reward.functions`, built once (models load in the constructor)."""

    def __init__(self, functions: Mapping[str, Any] | Sequence[RewardSpec]) -> None:
        self.specs = list(functions) if isinstance(functions, Sequence) else reward_specs(functions)
        if not self.specs:
            raise ValueError("MultiReward needs at least one reward")
        self.rewards: dict[str, Reward] = {}
        for spec in self.specs:
            try:
                self.rewards[spec.name] = build_reward(spec.name, spec.args)
            except Exception as err:
                err.add_note(f"while building reward.functions.{spec.name} (args {dict(spec.args)})")
                raise
        #: Whether any reward reads the source images of an edit run (else they are never decoded).
        self.takes_sources = any(takes_sources(r) for r in self.rewards.values())
        # The source images the last micro-batch decoded: the samples of one prompt often span two
        # consecutive micro-batches, and its image is then decoded once.
        self._decoded: dict[Any, torch.Tensor] = {}

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> RewardBatch:
        """Score one micro-batch with every reward; see the module docstring for failures.

        `sources`: each sample's condition images in an edit run (`ConditionImage`s or uint8
        `[3, H, W]` tensors; diffrl.rewards.base), decoded here once each, only when a reward
        reads them."""
        rows = check_batch(pixels, prompts, metadata)
        pixels = pixels.detach().cpu()
        batch = int(pixels.shape[0])
        decoded: list | None = None  # the sources as tensors, once a reward that reads them asks
        total_B = torch.zeros(batch, dtype=torch.float32)
        scores, extras, failed, failed_batches, seconds = {}, {}, {}, {}, {}
        for spec in self.specs:
            start = time.perf_counter()
            try:
                if decoded is None and sources is not None and takes_sources(self.rewards[spec.name]):
                    decoded = self._decode(sources, batch)
                output = call_reward(
                    self.rewards[spec.name], pixels, prompts, rows, spec.name, spec.video_frames, decoded
                )
            except Exception as err:
                if spec.required:
                    raise RewardError(
                        f"required reward {spec.name!r} failed on a micro-batch of {batch} sample(s): "
                        f"{type(err).__name__}: {err}{_raised_at(err)}. Fix the cause, or set "
                        f"reward.functions.{spec.name}.required=false to score such batches 0 and count the failures."
                    ) from err
                logger.warning(
                    "reward %r failed on a micro-batch of %d sample(s); they score 0 for it "
                    "(counted in rewards/%s/failed_batches): %s: %s",
                    spec.name,
                    batch,
                    metric_name(spec.name),
                    type(err).__name__,
                    err,
                )
                scores[spec.name] = torch.zeros(batch, dtype=torch.float32)
                failed[spec.name] = torch.ones(batch, dtype=torch.bool)
                failed_batches[spec.name] = 1
            else:
                scores[spec.name] = output.scores_B
                failed[spec.name] = torch.zeros(batch, dtype=torch.bool)
                failed_batches[spec.name] = 0
                extras.update({f"{spec.name}/{key}": value for key, value in output.extras.items()})
                total_B += spec.weight * output.scores_B
            seconds[spec.name] = time.perf_counter() - start
        return RewardBatch(total_B, scores, extras, failed, failed_batches, seconds)

    def _decode(self, sources: Sequence[Sequence[Any]], batch: int) -> list:
        """`decode_sources` with the images the previous micro-batch decoded at hand (the samples
        of one prompt often span two consecutive micro-batches); keeps this batch's only."""
        decoded = decode_sources(sources, batch, self._decoded)
        keys = {getattr(item, "key", None) for row in sources for item in row}
        self._decoded = {key: image for key, image in self._decoded.items() if key in keys}
        return decoded
