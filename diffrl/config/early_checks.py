"""Checks of a command's inputs that need no heavy import: the model directory and a device name.

Why here: torch, diffusers, transformers and Ray take 5-20 s to import (more on a loaded host), and
`diffrl.models` imports torch and diffusers as it loads. The CLI runs these checks, with the config
load, before it imports a command's module, so a mistyped path or device is an error within a
second. Stdlib only (torch only where the answer needs it: which CUDA devices a machine with a GPU
driver has). The later checks (`diffrl.models.read_model_index`, `diffrl.rollout.generate`) use
the same functions, so both say the same thing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: `owner/name`, as Hugging Face Hub ids are written (a relative path of two parts looks the same:
#: it is only called an id when no such directory exists).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: model.path prefixes naming models diffrl ships or builds (`diffrl.models.resolve_model_path`).
NAMED_MODEL_PREFIXES = ("toy:", "tiny:")

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")
#: Files present where a CUDA (NVIDIA) or ROCm (AMD, which torch also calls "cuda") driver is.
_GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def check_model_dir(path: str | Path) -> None:
    """Raise the error for a model.path that cannot be a diffusers directory: empty, not a
    directory (with the download command when it looks like a Hub id), or without model_index.json.
    `toy:`/`tiny:` names pass (their resolution checks them)."""
    text = str(path)
    if not text:
        raise ValueError("model.path is empty: set it to a local diffusers directory (with model_index.json)")
    if text.startswith(NAMED_MODEL_PREFIXES):
        return
    root = Path(text)
    if not root.is_dir():
        if HUB_ID.fullmatch(text):
            local = f"models/{text.split('/')[1]}"
            raise FileNotFoundError(
                f"model.path={text!r} is not a directory; it looks like a Hugging Face Hub id, and diffrl loads "
                f"local directories only (it never downloads weights). Download it once with `hf download "
                f"{text} --local-dir {local}` (huggingface_hub's command; `hf auth login` first for a gated "
                f"model), then set model.path={local}"
            )
        raise FileNotFoundError(
            f"model.path={text!r} is not a directory: point it to a local diffusers model directory "
            "(diffrl never downloads weights)"
        )
    if not (root / "model_index.json").exists():
        raise FileNotFoundError(
            f"{root / 'model_index.json'} is missing: {text!r} is not a diffusers pipeline directory "
            "(save one with pipeline.save_pretrained(dir))"
        )


def may_have_gpu() -> bool:
    """False when this machine surely has no CUDA device (no GPU driver's files), so that asking
    for one is refused without importing torch; True means torch must say."""
    return any(os.path.exists(p) for p in _GPU_DRIVER_FILES)


def check_device(device: str, flag: str = "--device") -> str:
    """`device` when it names a device diffrl runs on (cpu, cuda, cuda:N) and this machine has it,
    else a ValueError naming what there is. torch is imported only to count the CUDA devices of a
    machine with a GPU driver."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise ValueError(f"{flag} {device!r} is not a device diffrl runs on: cpu, cuda or cuda:N")
    if match[1] == "cpu":
        return device
    count = 0
    if may_have_gpu():
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"{flag} {device!r}: this machine has no CUDA device; use {flag} cpu")
    if match[2] is not None and int(match[2]) >= count:
        raise ValueError(
            f"{flag} {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return device
