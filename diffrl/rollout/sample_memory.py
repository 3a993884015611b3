"""`diffrl sample`'s memory check, before the model loads: the images of one call and the VAE
decoding of one micro-batch must fit the device's memory, else a ValueError (exit 2) naming the flag
to change, the bound and the largest value that fits.

What one call holds at least (`diffrl.models.memory`'s lower bounds, so a refusal means it cannot
fit, and passing does not promise it will):
- every sample until the files are written (the sampler returns them all at once): its uint8
  pixels and its fp32 latents: the initial and final ones (ODE), or with --noise-level > 0 every
  step's latents and SDE means (2 x steps + 2);
- while a micro-batch decodes, the VAE decoder's full-resolution activations of each of its samples.

The device's memory: on the CPU, what this process may use (`memory_limit`: physical memory,
cgroup v1/v2 limits, rlimits); on a GPU, its total memory (the samples stay on it until written).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffrl.files import read_json_file
from diffrl.models.memory import GIB, MemoryLimit, decoder_activation_bytes, latent_elements, memory_limit
from diffrl.models.sampling import ImageGeometry

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SampleMemory:
    """Lower bounds, in bytes, of one sample's cost at a size: `kept` until the call ends,
    `decoding` while its micro-batch decodes."""

    kept: int
    decoding: int

    def need(self, images: int, micro_batch_size: int) -> int:
        return images * self.kept + min(micro_batch_size, images) * self.decoding


def vae_config(root: Path) -> dict[str, Any] | None:
    """The model's vae/config.json; None in pixel space (no vae folder)."""
    if not (root / "vae").exists():
        return None
    fix = "the model directory's VAE config must be the JSON its save_pretrained wrote"
    data = read_json_file(root / "vae" / "config.json", "the VAE config", fix)
    return data if isinstance(data, dict) else {}


def sample_memory(
    vae: dict[str, Any] | None, height: int, width: int, frames: int, steps: int, stochastic: bool, dtype: str
) -> SampleMemory:
    latents = (2 * steps + 2) if stochastic else 2
    kept = 3 * height * width * max(1, frames) + 4 * latent_elements(vae, height, width, frames) * latents
    return SampleMemory(kept, decoder_activation_bytes(vae, height, width, DTYPE_BYTES[dtype]))


def device_memory(device: torch.device) -> MemoryLimit:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return MemoryLimit(properties.total_memory, f"{properties.name}'s memory, cuda:{index}")
    return memory_limit()


def size_text(count: int) -> str:
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / (1 << 20):.1f} MiB"


def _largest(fits, top: int) -> int:
    """The largest value in [0, top] for which `fits` holds (it holds below any value that fits)."""
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_sample_memory(
    root: Path,
    *,
    prompts: int,
    n: int,
    micro_batch_size: int,
    height: int,
    width: int,
    frames: int,
    steps: int,
    stochastic: bool,
    dtype: str,
    device: torch.device,
) -> None:
    """Raise ValueError unless `prompts` x `n` samples and one micro-batch's decoding fit the
    device's memory (the module docstring): the message names the flag to lower first (the image
    size when one sample alone does not fit, else -n when the samples kept do not, else
    --micro-batch-size), the bound and the largest value that fits."""
    vae = vae_config(root)
    limit = device_memory(device)
    memory = limit.bytes

    def cost(h: int, w: int) -> SampleMemory:
        return sample_memory(vae, h, w, frames, steps, stochastic, dtype)

    per = cost(height, width)
    images = prompts * n
    need = per.need(images, micro_batch_size)
    if need <= memory:
        return
    each = (
        f"each sample keeps {size_text(per.kept)} until the files are written (pixels, latents) and its VAE "
        f"decoding holds {size_text(per.decoding)} ({dtype})"
    )
    over = f"more than this machine's {limit.describe()}"
    if per.need(1, 1) > memory:
        multiple = ImageGeometry.read(root).multiple or 16

        def scaled(k: int) -> tuple[int, int]:  # k multiples high, the width at the same aspect ratio
            return k * multiple, k * multiple * width // height // multiple * multiple

        def one_fits(k: int) -> bool:
            h, w = scaled(k)
            return k == 0 or (w >= multiple and cost(h, w).need(1, 1) <= memory)

        h, w = scaled(_largest(one_fits, max(1, height // multiple)))
        hint = (
            f"pass --height {h} --width {w} or less (the same aspect ratio)"
            if h >= multiple and w >= multiple
            else "no image size this model takes fits"
        )
        frames_text = f" x {frames} frames" if frames > 1 else ""
        raise ValueError(
            f"--height {height} --width {width}{frames_text}: one sample needs at least "
            f"{size_text(per.need(1, 1))}, {over}: {hint}"
            + (", or fewer --num-frames" if frames > 1 else "")
            + f"; {each}"
        )
    if per.need(images, 1) > memory:  # the samples kept do not fit, whatever the micro-batch
        most = _largest(lambda k: per.need(prompts * k, micro_batch_size) <= memory, n)
        at_one = _largest(lambda k: per.need(prompts * k, 1) <= memory, n)
        if most >= 1:
            fix = f"pass -n {most} or less"
        elif at_one >= 1:
            fix = f"pass -n {at_one} --micro-batch-size 1"
        else:
            fix = (
                f"sample at most {_largest(lambda k: per.need(k, 1) <= memory, prompts)} prompts per call, "
                "with -n 1 --micro-batch-size 1"
            )
        raise ValueError(
            f"-n {n}: {prompts} prompt(s) x {n} = {images} samples need at least {size_text(need)}, {over}: "
            f"{fix}; {each}"
        )
    most = _largest(lambda k: per.need(images, k) <= memory, micro_batch_size)
    raise ValueError(
        f"--micro-batch-size {micro_batch_size}: decoding {min(micro_batch_size, images)} of the {images} samples "
        f"at once needs at least {size_text(need)}, {over}: pass --micro-batch-size {most} or less; {each}"
    )
