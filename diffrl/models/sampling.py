"""What a model directory says about sampling it: the image sizes it takes, and the settings it was
trained (or validated) with, so `diffrl sample` needs no flags to draw what the model learned.

- `ImageGeometry` reads the model's config files (no weights): a side must be a multiple of the
  VAE's downsampling times the transformer's patch size and, with `pos_embed_max_size`, at most that
  many patches; the default side is the transformer's `sample_size` times the VAE factor (what
  diffusers' pipelines use when no height is given).
- `SAMPLING_FILE` (diffrl_sampling.json) holds the sampler settings a model or an adapter goes with:
  a run's export (LoRA or merged pipeline) writes its validation sampler there, and the shipped
  `toy:shapes` model has one. `diffrl sample` takes every setting not given on its command line
  from the LoRA's file, then the model's, then `GENERIC` (with the model's own default side).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffrl.files import naming, read_json_file
from diffrl.models.base import MODEL_DIR_FIX

SAMPLING_FILE = "diffrl_sampling.json"

#: Settings of `diffrl sample` and their defaults for a model that declares none (height and width:
#: the model's own default side when its config gives one).
GENERIC: dict[str, Any] = {
    "height": 512,
    "width": 512,
    "steps": 28,
    "guidance_scale": 4.5,
    "max_sequence_length": 256,
    "num_frames": 1,
    "negative_prompt": "",
}
#: Optional extra keys: the grammar every prompt must follow ("shapes": the shapes world's), and
#: `sigmas`, the sampler's own schedule σ_0 > ... > σ_{N-1} for N = steps (a few-step student's:
#: `rollout.pipeline.sigmas`), used only when the steps are N.
PROMPT_GRAMMARS = ("shapes",)
#: The prompt of the `diffrl sample` commands diffrl prints, per grammar (None: no grammar).
EXAMPLE_PROMPTS: dict[str | None, str] = {
    "shapes": "a red circle and a blue square",
    None: "a photo of a cat",
}
KEYS = (*GENERIC, "prompt_grammar", "sigmas")


def _read_json(file: Path) -> dict | None:
    if not file.exists():
        return None
    data = read_json_file(file, "model config", MODEL_DIR_FIX)
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class ImageGeometry:
    """Image sides a model takes, from its config files; None where they do not say."""

    factor: int | None  # VAE downsampling (1 in pixel space)
    patch: int | None
    largest: int | None  # the largest side in pixels (pos_embed_max_size patches), if bounded
    default_side: int | None  # transformer sample_size x factor

    @property
    def multiple(self) -> int | None:
        return None if self.factor is None or self.patch is None else self.factor * self.patch

    @classmethod
    def read(cls, root: Path) -> ImageGeometry:
        vae, transformer = (
            _read_json(root / "vae" / "config.json"),
            _read_json(root / "transformer" / "config.json"),
        )
        if transformer is None:
            return cls(None, None, None, None)
        if vae is None:
            factor = 1 if not (root / "vae").exists() else None
        elif isinstance(vae.get("block_out_channels"), list):
            factor = 2 ** (len(vae["block_out_channels"]) - 1)
        elif isinstance(vae.get("temperal_downsample"), list):
            factor = 2 ** len(vae["temperal_downsample"])
        else:
            factor = None
        patch = transformer.get("patch_size") or 1
        patch = patch[-1] if isinstance(patch, list) else patch
        patch = patch if isinstance(patch, int) else None
        largest = transformer.get("pos_embed_max_size")
        multiple = None if factor is None or patch is None else factor * patch
        largest = largest * multiple if isinstance(largest, int) and multiple else None
        sample_size = transformer.get("sample_size")
        default = sample_size * factor if isinstance(sample_size, int) and factor else None
        return cls(factor, patch, largest, default)

    def nearest(self, value: int) -> int:
        """The side closest to `value` that the model takes (`value` when unknown)."""
        multiple = self.multiple
        if multiple is None:
            return value
        nearest = max(multiple, round(value / multiple) * multiple)
        return nearest if self.largest is None else min(nearest, self.largest)

    def problem(self, value: int) -> str | None:
        """Why a side of `value` pixels does not fit; None if it fits (or the configs do not say)."""
        multiple = self.multiple
        if multiple is None or not (value % multiple or (self.largest is not None and value > self.largest)):
            return None
        limit = f" and at most {self.largest}" if self.largest is not None else ""
        return f"it takes sides that are multiples of {multiple} (VAE factor {self.factor} x patch {self.patch}){limit}"


def read_sampling_file(folder: Path) -> dict[str, Any] | None:
    """The settings in `folder`/diffrl_sampling.json, checked; None when there is no such file."""
    file = Path(folder) / SAMPLING_FILE
    data = _read_json(file)
    if data is None:
        if file.is_file():
            raise ValueError(f"{file} must hold a JSON object of sampler settings ({', '.join(KEYS)})")
        return None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"{file}: unknown setting(s) {unknown}; valid: {', '.join(KEYS)}")
    grammar = data.get("prompt_grammar")
    if grammar is not None and grammar not in PROMPT_GRAMMARS:
        raise ValueError(f"{file}: prompt_grammar={grammar!r} is not one of {PROMPT_GRAMMARS}")
    sigmas = data.get("sigmas")
    if sigmas is not None and (
        not isinstance(sigmas, list)
        or not sigmas
        or not all(isinstance(s, (int, float)) and 0 < s <= 1 for s in sigmas)
        or any(b >= a for a, b in itertools.pairwise(sigmas))
    ):
        raise ValueError(f"{file}: sigmas={sigmas!r} must be a list of decreasing numbers in (0, 1]")
    return data


def write_sampling_file(folder: Path, settings: dict[str, Any]) -> Path:
    unknown = sorted(set(settings) - set(KEYS))
    assert not unknown, unknown
    file = Path(folder) / SAMPLING_FILE
    with naming(file):
        file.write_text(json.dumps(settings, indent=2) + "\n")
    return file


def settings_of_run(rollout: Any, prompt_grammar: str | None = None) -> dict[str, Any]:
    """A run's validation sampler (its `rollout` config) as sampler settings: what its reported
    accuracy and image grids were drawn with."""
    pipe = rollout.pipeline
    settings = {
        "height": pipe.height,
        "width": pipe.width,
        "steps": rollout.val.num_inference_steps or pipe.num_inference_steps,
        "guidance_scale": pipe.guidance_scale,
        "max_sequence_length": pipe.max_sequence_length,
        "num_frames": pipe.num_frames,
        "negative_prompt": pipe.negative_prompt,
    }
    if prompt_grammar is not None:
        settings["prompt_grammar"] = prompt_grammar
    if pipe.sigmas is not None and len(pipe.sigmas) == settings["steps"]:
        settings["sigmas"] = [float(s) for s in pipe.sigmas]
    return settings


def resolve_sampling(
    model_root: Path | None, lora_dir: Path | None, given: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every sampler setting: `given` (the command line; None = not given), else the LoRA's
    sampling file, else the model's, else `GENERIC` (height and width: the model's default side).
    Returns (settings, where each came from)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if lora_dir is not None and (found := read_sampling_file(lora_dir)) is not None:
        layers.append((str(lora_dir / SAMPLING_FILE), found))
    if model_root is not None and (found := read_sampling_file(model_root)) is not None:
        layers.append((str(model_root / SAMPLING_FILE), found))
    generic = dict(GENERIC)
    if model_root is not None and (side := ImageGeometry.read(model_root).default_side) is not None:
        generic["height"] = generic["width"] = side
    layers.append(("defaults", generic))
    settings: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in KEYS:
        if given.get(key) is not None:
            settings[key], sources[key] = given[key], "command line"
            continue
        for where, layer in layers:
            if layer.get(key) is not None:
                settings[key], sources[key] = layer[key], where
                break
    settings.setdefault("prompt_grammar", None)
    if settings.get("sigmas") is not None and len(settings["sigmas"]) != settings["steps"]:
        del settings["sigmas"], sources["sigmas"]  # a schedule for other steps (--steps given)
    settings.setdefault("sigmas", None)
    return settings, sources
