"""`diffrl sample`: generate images or videos from a model directory, written to a folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image

from diffrl.config.schema import PipelineConfig, RolloutConfig, ValidationConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def generate(
    model: str,
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    n: int = 1,
    seed: int = 0,
    steps: int = 28,
    guidance_scale: float = 4.5,
    height: int = 512,
    width: int = 512,
    num_frames: int = 1,
    negative_prompt: str = "",
    max_sequence_length: int = 256,
    noise_level: float = 0.0,
    dtype: str | None = None,
    device: str | None = None,
    micro_batch_size: int = 8,
    fps: int = 16,
) -> list[Path]:
    """Sample `n` images (or videos) per prompt and write them with a manifest, samples.jsonl.

    Sample j of prompt i uses the noise keyed (seed, 0, i·n + j): the same call gives the same files.
    """
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    device = device or default_device()
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    adapter = load_model(model, dtype=dtype, device=device)
    cfg = RolloutConfig(
        n=n,
        micro_batch_size=micro_batch_size,
        pipeline=PipelineConfig(
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            max_sequence_length=max_sequence_length,
            num_frames=num_frames,
            negative_prompt=negative_prompt,
        ),
        val=ValidationConfig(n=n, seed=seed, num_inference_steps=steps, noise_level=noise_level),
    )
    cfg.pipeline.validate("sample")
    cfg.val.validate("sample")
    rollout = TrajectorySampler(adapter, cfg).sample_validation(list(prompts))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with open(out / "samples.jsonl", "w") as manifest:
        for b, (pixels, p) in enumerate(
            zip(rollout.samples.pixels, rollout.samples.prompt_index_B.tolist(), strict=True)
        ):
            path = out / f"{p:03d}_{b % n:02d}{'.gif' if adapter.is_video else '.png'}"
            _save(pixels, path, fps)
            written.append(path)
            manifest.write(
                json.dumps({"file": path.name, "prompt": prompts[p], "seed": seed, "sample": b % n}) + "\n"
            )
    return written


def _save(pixels: torch.Tensor, path: Path, fps: int) -> None:
    if pixels.dim() == 3:  # [3, H, W]
        Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy()).save(path)
        return
    frames = [Image.fromarray(frame.permute(1, 2, 0).cpu().numpy()) for frame in pixels]  # [T, 3, H, W]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
