"""Upper bounds of size-like settings, checked before any model loads or Ray starts.

The schema checks each key's lower bound and type; what a key may not exceed depends on the
model and the machine, so it is checked here, from the model's config files and the machine's
memory, with the key named in a ConfigError (exit 2) and the largest value that fits:

- `rollout.pipeline.num_inference_steps`, `rollout.val.num_inference_steps`,
  `rollout.pipeline.max_sequence_length`: the model directory's bounds (`diffrl.models.bounds`:
  the scheduler's `num_train_timesteps`, the text encoder's token limit);
- `model.lora.rank`: at most the transformer's width (`num_attention_heads x attention_head_dim`):
  a LoRA of higher rank than the layers it adapts adds memory, not capacity;
- the images of one step (`data.prompts_per_step x rollout.n`) and of one validation
  (validation prompts x `rollout.val.n`): their pixels and trajectory latents must fit the
  memory this process may use (`diffrl.models.memory.memory_limit`: physical memory, cgroup v1/v2
  limits, RLIMIT_AS/RLIMIT_DATA; `estimate_image_bytes`, a lower bound: a refusal means it cannot
  fit; passing does not promise it will).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffrl.config.schema import Config, ConfigError
from diffrl.models import resolve_model_path
from diffrl.models.bounds import check_model_bounds
from diffrl.models.memory import GIB, latent_elements, memory_limit


def _config(root: Path, name: str) -> dict[str, Any]:
    """A component's config (already parsed once by preflight's model file check), or {}."""
    file = root / name
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else {}


def estimate_image_bytes(cfg: Config, vae: dict[str, Any] | None) -> int:
    """Bytes one sampled image holds at least while its step runs: its uint8 pixels, and its
    fp32 latents (`latent_elements`; `vae` None: pixel space) at every stored point of the SDE
    window (x_k..x_{k+W} and the W means)."""
    pipe = cfg.rollout.pipeline
    frames = max(1, pipe.num_frames)
    pixels = 3 * pipe.height * pipe.width * frames
    latent = 4 * latent_elements(vae, pipe.height, pipe.width, frames)
    window = cfg.rollout.sde.window_size or 1  # null: the window range, at least one step
    return pixels + latent * (2 * window + 1)


def check_sizes(cfg: Config, validation_prompts: int) -> None:
    """Every bound of the module docstring; raises ConfigError naming the key and the fix."""
    root = resolve_model_path(cfg.model.path)
    transformer = _config(root, "transformer/config.json")
    pipe, val = cfg.rollout.pipeline, cfg.rollout.val
    try:
        check_model_bounds(
            root,
            {
                "rollout.pipeline.num_inference_steps": pipe.num_inference_steps,
                "rollout.val.num_inference_steps": val.num_inference_steps,
            },
            {"rollout.pipeline.max_sequence_length": pipe.max_sequence_length},
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    heads, head_dim = transformer.get("num_attention_heads"), transformer.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int) and cfg.model.lora.rank > heads * head_dim:
        raise ConfigError(
            f"model.lora.rank={cfg.model.lora.rank} is more than the transformer's width {heads * head_dim} "
            f"(num_attention_heads {heads} x attention_head_dim {head_dim}): a higher rank adds memory, not "
            f"capacity; set model.lora.rank <= {heads * head_dim}"
        )
    vae = _config(root, "vae/config.json") if (root / "vae").exists() else None
    per_image = estimate_image_bytes(cfg, vae)
    limit = memory_limit()
    memory = limit.bytes
    step_images = cfg.data.prompts_per_step * cfg.rollout.n
    if step_images * per_image > memory:
        fits = max(1, memory // (per_image * cfg.rollout.n))
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} x rollout.n={cfg.rollout.n} = {step_images} images "
            f"per step need at least {step_images * per_image / GIB:.1f} GiB ({per_image} bytes each: pixels and "
            f"the SDE window's latents), more than this machine's {limit.describe()}: set "
            f"data.prompts_per_step <= {fits} (or lower rollout.n)"
        )
    val_images = validation_prompts * cfg.rollout.val.n
    if val_images * per_image > memory:
        raise ConfigError(
            f"rollout.val.n={cfg.rollout.val.n} x {validation_prompts} validation prompts = {val_images} images need "
            f"at least {val_images * per_image / GIB:.1f} GiB, more than this machine's {limit.describe()}: "
            f"set rollout.val.n <= {max(1, memory // (per_image * max(1, validation_prompts)))}"
        )
