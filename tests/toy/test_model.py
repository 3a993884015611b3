"""`build_toy`: the shipped `toy:shapes` architecture by default, larger transformers on request."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffrl.toy import PRETRAINED_DIR
from diffrl.toy.model import build_toy

ARCH_KEYS = (
    "attention_head_dim",
    "caption_projection_dim",
    "num_attention_heads",
    "num_layers",
    "patch_size",
)


def transformer_config(path) -> dict:
    return json.loads((path / "transformer" / "config.json").read_text())


def test_default_is_the_shipped_architecture_and_text_encoders(tmp_path):
    built = build_toy(tmp_path / "toy", seed=0)
    shipped = PRETRAINED_DIR / "shapes"
    ours, theirs = transformer_config(built), transformer_config(shipped)
    assert {k: ours[k] for k in ARCH_KEYS} == {k: theirs[k] for k in ARCH_KEYS}
    # pretraining leaves the text encoders frozen at build_toy's seeded init: the shipped ones are
    # what seed 0 builds, rounded to the bfloat16 the model was pretrained and saved in
    for encoder in ("text_encoder", "text_encoder_2"):
        a = load_file(built / encoder / "model.safetensors")
        b = load_file(shipped / encoder / "model.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k].to(b[k].dtype), b[k]) for k in a)


def test_width_and_layers_size_the_transformer(tmp_path):
    built = build_toy(tmp_path / "wide", seed=0, width=256, layers=8)
    config = transformer_config(built)
    assert (config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]) == (256, 8)
    assert config["caption_projection_dim"] == 256
    weights = load_file(built / "transformer" / "diffusion_pytorch_model.safetensors")
    blocks = {k.split(".")[1] for k in weights if k.startswith("transformer_blocks.")}
    assert len(blocks) == 8
    assert weights["transformer_blocks.0.attn.to_q.weight"].shape == (256, 256)


@pytest.mark.parametrize("width, layers", [(100, 6), (0, 6), (128, 0)])
def test_bad_sizes_name_the_values(tmp_path, width, layers):
    with pytest.raises(ValueError, match=f"width={width}, layers={layers}"):
        build_toy(tmp_path / "bad", width=width, layers=layers)
