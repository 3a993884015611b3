"""The random full-size pipelines have the published architectures: parameter counts checked
against the published checkpoints' safetensors totals, from meta models (no memory, no GPU). The
edit families are also built on the CPU with one block per stack, checked and saved, and load
through diffrl."""

import json
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
    "wan22_a14b": 14_288_491_584,  # Wan-AI/Wan2.2-T2V-A14B-Diffusers, each of its two experts
    # The edit models' transformers are their bases' architectures (derived, not read: see
    # random_pipelines.FAMILIES): black-forest-labs/FLUX.1-Kontext-dev, Qwen/Qwen-Image-Edit.
    "flux_kontext": 11_901_408_320,
    "qwen_image_edit": 20_430_401_088,
}
EDIT_FAMILIES = {"flux_kontext": "FluxKontextPipeline", "qwen_image_edit": "QwenImageEditPipeline"}
#: config key -> the transformer's ModuleList of those blocks (FLUX and Qwen-Image name them alike)
BLOCK_LISTS = {"num_layers": "transformer_blocks", "num_single_layers": "single_transformer_blocks"}


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


@pytest.mark.parametrize("family", sorted(EDIT_FAMILIES))
def test_plan_reports_the_published_count(family, capsys):
    rp.main([family, "--plan"])
    info = json.loads(capsys.readouterr().out)
    assert info["params"] == info["published_params"] == PUBLISHED_TRANSFORMER_PARAMS[family]


def _layer_scaled_params(family: str, layers: int) -> int:
    """The published count less the blocks `layers` drops from each stack: full - sum over stacks of
    (blocks dropped) x (one block's parameters)."""
    model = rp.empty_transformer(family, layers)
    full = rp.transformer_config(family)
    return PUBLISHED_TRANSFORMER_PARAMS[family] - sum(
        (full[key] - min(layers, full[key]))
        * sum(p.numel() for p in getattr(model, BLOCK_LISTS[key])[0].parameters())
        for key in rp.FAMILIES[family].layer_keys
    )


@pytest.fixture
def small_condition_resize(monkeypatch):
    """The adapters resize a condition image to about one megapixel, as the pipelines do; the
    full-size VAE encodes that in 27 s (FLUX) and 50 s (Qwen-Image) on 2 CPU cores, and the one
    transformer block then runs over ~4,100 more tokens. Here a 64x64 image is encoded at its own
    size (16 condition tokens): the same code path, smaller."""
    from diffrl.models import flux_kontext, qwen_image_edit

    monkeypatch.setattr(flux_kontext.FluxKontextAdapter, "auto_resize", False)
    monkeypatch.setattr(qwen_image_edit, "VAE_IMAGE_AREA", 64 * 64)


@pytest.mark.parametrize("family", sorted(EDIT_FAMILIES))
def test_edit_family_builds_checks_saves_and_loads(family, tmp_path, small_condition_resize):
    from diffrl.models import load_model

    summary = rp.write(family, tmp_path / family, "cpu", layers=1)
    expected = _layer_scaled_params(family, 1)
    assert summary["transformer_params"] == rp.plan(family, 1)["params"] == expected
    assert summary["sanity"]["condition_tokens"] == 16
    assert all(v == v and abs(v) < 1e4 for v in summary["sanity"].values())  # finite

    index = json.loads((tmp_path / family / "model_index.json").read_text())
    assert index["_class_name"] == EDIT_FAMILIES[family]
    adapter = load_model(tmp_path / family, "bfloat16", "cpu")
    assert type(adapter).__name__ == EDIT_FAMILIES[family].replace("Pipeline", "Adapter")
    assert sum(p.numel() for p in adapter.transformer.parameters()) == expected
    if family == "qwen_image_edit":
        # The processor is saved under the real class and makes the real model's image tokens: a
        # 1024² condition image (the pipeline's resize) is 74 x 74 patches of 14 pixels (sides
        # rounded to multiples of 28), 37 x 37 = 1,369 tokens after the 2x2 merge.
        assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
        processor = adapter.pipe.processor
        grid = processor(text=["<|image_pad|>"], images=[rp.condition_image(1024, 1024)], return_tensors="pt")
        assert grid["image_grid_thw"].tolist() == [[1, 74, 74]]
    assert rp.sanity_check(adapter.pipe, "cpu")["condition_tokens"] == 16
