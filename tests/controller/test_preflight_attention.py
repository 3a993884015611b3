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
        ("tiny_flux_kontext", [], True, True),  # a FLUX family, the default backend, a GPU
        ("tiny_flux_kontext", ["model.attn_backend=_native_flash"], True, False),  # the fix
        ("tiny_flux_kontext", [], False, False),  # no GPU: torch's CPU attention trains
        ("tiny_sd3", [], True, False),  # SD3 trains with the default
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
