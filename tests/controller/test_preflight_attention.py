"""The preflight's warning for a family whose training backward fails under torch's default attention
on a GPU (FLUX: docs/performance.md), said before any model loads."""

from __future__ import annotations

import pytest
import torch

from diffrl.config import load_config
from diffrl.controller.preflight import preflight_common


@pytest.mark.parametrize(
    ("preset", "overrides", "gpu", "warned"),
    [
        ("tiny_flux_kontext", ["model.attn_backend=native"], True, True),  # FLUX, torch's default, a GPU
        ("tiny_flux_kontext", ["model.attn_backend=_native_flash"], True, False),  # the fix
        ("tiny_flux_kontext", [], True, False),  # auto (the default) picks the fix
        ("tiny_flux_kontext", ["model.attn_backend=native"], False, False),  # no GPU: CPU attention trains
        ("tiny_sd3", ["model.attn_backend=native"], True, False),  # SD3 trains with the default
    ],
)
def test_flux_with_the_default_attention_on_a_gpu_is_warned(
    monkeypatch, capsys, preset, overrides, gpu, warned
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    preflight_common(load_config(preset, overrides))
    out = capsys.readouterr().out
    assert ("model.attn_backend=_native_flash" in out) == warned, out
    if warned:
        assert "FluxKontextPipeline trains with model.attn_backend=native" in out


@pytest.mark.parametrize(
    ("pipeline", "device", "setting", "expected"),
    [
        ("FluxKontextPipeline", "cuda", "auto", "_native_flash"),  # FLUX's gpu_training_attn_backend
        ("FluxPipeline", "cuda", "auto", "_native_flash"),
        ("FluxKontextPipeline", "cpu", "auto", "native"),
        ("StableDiffusion3Pipeline", "cuda", "auto", "native"),  # SD3 declares none: the default trains
        ("FluxKontextPipeline", "cuda", "native", "native"),  # an explicit choice stands
        ("StableDiffusion3Pipeline", "cpu", "flash", "flash"),
    ],
)
def test_auto_attention_is_the_familys_gpu_training_backend_on_a_gpu(pipeline, device, setting, expected):
    from diffrl.models import adapter_class
    from diffrl.workers.rollout_worker import attention_backend

    family = adapter_class(pipeline)
    adapter = family.__new__(family)  # the choice depends on the family and the device only
    adapter.device = torch.device(device)
    assert attention_backend(setting, adapter) == expected
