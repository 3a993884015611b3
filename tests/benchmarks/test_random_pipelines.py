"""The random full-size pipelines have the published architectures: parameter counts checked
against the published checkpoints' safetensors totals, from meta models (no memory, no GPU)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import random_pipelines as rp

# Parameter totals of the published checkpoints (the safetensors metadata the Hub shows), written
# out here rather than read from random_pipelines so that a changed config there fails.
PUBLISHED_TRANSFORMER_PARAMS = {
    "flux_dev": 11_901_408_320,  # black-forest-labs/FLUX.1-dev transformer ("11.9B")
    "qwen_image": 20_430_401_088,  # Qwen/Qwen-Image transformer ("20B")
    "wan21_1_3b": 1_418_996_800,  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer
    "wan21_14b": 14_288_491_584,  # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer
}


@pytest.mark.parametrize("family", sorted(PUBLISHED_TRANSFORMER_PARAMS))
def test_transformer_parameter_count_is_the_published_one(family):
    assert rp.plan(family)["params"] == PUBLISHED_TRANSFORMER_PARAMS[family]
    assert rp.plan(family)["bf16_weight_gb"] == pytest.approx(2 * PUBLISHED_TRANSFORMER_PARAMS[family] / 1e9)


def test_vae_parameter_counts_are_the_published_ones():
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    with init_empty_weights():
        counts = {
            name: sum(p.numel() for p in cls(**config).parameters())
            for name, cls, config in [
                ("flux", AutoencoderKL, rp.FLUX_VAE),
                ("qwen_image", AutoencoderKLQwenImage, rp.QWEN_IMAGE_VAE),
                ("wan", AutoencoderKLWan, rp.WAN_VAE),
            ]
        }
    # FLUX.1-dev vae/ (83.8 M); Wan2.1's VAE (127 M), which Qwen-Image's VAE shares in shape.
    assert counts == {"flux": 83_819_683, "qwen_image": 126_892_531, "wan": 126_892_531}


def test_layers_caps_every_block_stack():
    config = rp.transformer_config("flux_dev", layers=2)
    assert (config["num_layers"], config["num_single_layers"]) == (2, 2)
    assert rp.transformer_config("wan21_1_3b", layers=100)["num_layers"] == 30
    with pytest.raises(ValueError, match="layers"):
        rp.transformer_config("wan21_1_3b", layers=0)
    with pytest.raises(ValueError, match="unknown family"):
        rp.plan("sd3")


def test_materialise_initialises_parameters_and_keeps_buffers():
    model = rp.materialise_(
        rp.empty_transformer("wan21_1_3b", layers=1), torch.device("cpu"), torch.bfloat16, 0
    )
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params.values())
    assert torch.count_nonzero(params["blocks.0.attn1.to_q.bias"]) == 0
    assert torch.all(params["blocks.0.attn1.norm_q.weight"] == 1)
    assert params["blocks.0.ffn.net.0.proj.weight"].float().std().item() == pytest.approx(
        rp.INIT_STD, rel=0.02
    )
    # The RoPE tables are buffers computed at construction, not parameters: they must survive.
    from diffusers import WanTransformer3DModel

    reference = WanTransformer3DModel(**rp.transformer_config("wan21_1_3b", layers=1))
    assert torch.equal(model.rope.freqs_cos, reference.rope.freqs_cos)
