"""The random full-size pipelines have the published architectures: parameter counts checked
against the published checkpoints' safetensors totals, from meta models (no memory, no GPU), and
those of the 2026 families' full-size text encoders. The edit families and the 2026 families are
also built on the CPU with one block per stack (the 2026 ones two heads wide), checked and saved,
and load through diffrl."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import random_pipelines as rp
import random_text_encoders as rte

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
    # The 2026 families: the Hub's safetensors totals where it shows one (Z-Image-Turbo, Qwen-Image
    # 2.1), the published configs' counts for FLUX.2 ("4B", "9B", "32B" on the model cards).
    "flux2_klein_4b": 3_875_544_576,  # black-forest-labs/FLUX.2-klein-4B
    "flux2_klein_9b": 9_078_581_248,  # black-forest-labs/FLUX.2-klein-9B
    "flux2_dev": 32_223_281_152,  # black-forest-labs/FLUX.2-dev
    "zimage_turbo": 6_154_908_736,  # Tongyi-MAI/Z-Image-Turbo
    "qwen_image21": 7_115_124_736,  # Qwen/Qwen-Image-2.1
}
#: The full-size text encoders of the 2026 families (the Hub's safetensors totals).
PUBLISHED_TEXT_ENCODER_PARAMS = {
    "flux2_klein_4b": 4_022_468_096,  # Qwen/Qwen3-4B (tied embeddings)
    "flux2_klein_9b": 8_190_735_360,  # Qwen/Qwen3-8B
    "flux2_dev": 24_011_361_280,  # mistralai/Mistral-Small-3.2-24B-Instruct-2506
    "zimage_turbo": 4_022_468_096,  # Qwen/Qwen3-4B's base model
    "qwen_image21": 8_767_123_696,  # Qwen/Qwen3-VL-8B-Instruct
}
EDIT_FAMILIES = {"flux_kontext": "FluxKontextPipeline", "qwen_image_edit": "QwenImageEditPipeline"}
#: The families built on the CPU (one block per stack) by `test_family_builds_checks_saves_and_loads`.
BUILT_FAMILIES = {
    **EDIT_FAMILIES,
    "flux2_klein_4b": "Flux2KleinPipeline",
    "flux2_dev": "Flux2Pipeline",
    "zimage_turbo": "ZImagePipeline",
    "qwen_image21": "QwenImage21Pipeline",
}
#: config key -> the transformer's ModuleList of those blocks (FLUX and Qwen-Image name them alike)
BLOCK_LISTS = {"num_layers": "transformer_blocks", "num_single_layers": "single_transformer_blocks"}


@pytest.mark.parametrize("family", sorted(PUBLISHED_TRANSFORMER_PARAMS))
def test_transformer_parameter_count_is_the_published_one(family):
    assert rp.plan(family)["params"] == PUBLISHED_TRANSFORMER_PARAMS[family]
    assert rp.plan(family)["bf16_weight_gb"] == pytest.approx(2 * PUBLISHED_TRANSFORMER_PARAMS[family] / 1e9)


@pytest.mark.parametrize("family", sorted(PUBLISHED_TEXT_ENCODER_PARAMS))
def test_text_encoder_parameter_count_is_the_published_one(family):
    info = rp.plan(family)
    assert info["text_encoder_params"] == info["text_encoder_published_params"]
    assert info["text_encoder_params"] == PUBLISHED_TEXT_ENCODER_PARAMS[family]
    # the width the transformer reads: FLUX.2 stacks three hidden layers
    width = rte.text_encoder_config(family).get_text_config().hidden_size
    config = rp.transformer_config(family)
    assert width * (3 if family.startswith("flux2") else 1) == (
        config.get("joint_attention_dim") or config.get("cap_feat_dim") or config["context_in_dim"]
    )


def test_vae_parameter_counts_are_the_published_ones():
    from accelerate import init_empty_weights
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLFlux2,
        AutoencoderKLQwenImage,
        AutoencoderKLQwenImage21,
        AutoencoderKLWan,
    )

    with init_empty_weights():
        counts = {
            name: sum(p.numel() for p in cls(**config).parameters())
            for name, cls, config in [
                ("flux", AutoencoderKL, rp.FLUX_VAE),
                ("qwen_image", AutoencoderKLQwenImage, rp.QWEN_IMAGE_VAE),
                ("wan", AutoencoderKLWan, rp.WAN_VAE),
                ("flux2", AutoencoderKLFlux2, rp.FLUX2_VAE),
                ("qwen_image21", AutoencoderKLQwenImage21, rp.QWEN_IMAGE21_VAE),
                ("zimage", AutoencoderKL, rp.ZIMAGE_VAE),
            ]
        }
    # FLUX.1-dev vae/ (83.8 M), which Z-Image uses; Wan2.1's VAE (127 M), which Qwen-Image's VAE
    # shares in shape; the FLUX.2 and Qwen-Image 2.1 VAEs are their classes' defaults.
    assert counts == {
        "flux": 83_819_683,
        "qwen_image": 126_892_531,
        "wan": 126_892_531,
        "flux2": 84_046_115,
        "qwen_image21": 337_740_404,
        "zimage": 83_819_683,
    }


def test_layers_caps_every_block_stack():
    config = rp.transformer_config("flux_dev", layers=2)
    assert (config["num_layers"], config["num_single_layers"]) == (2, 2)
    assert rp.transformer_config("wan21_1_3b", layers=100)["num_layers"] == 30
    with pytest.raises(ValueError, match="layers"):
        rp.transformer_config("wan21_1_3b", layers=0)
    with pytest.raises(ValueError, match="unknown family"):
        rp.plan("sd3")
    # the 2026 families run two heads wide under --layers, their text width unchanged
    config = rp.transformer_config("zimage_turbo", layers=1)
    assert (config["n_layers"], config["dim"], config["cap_feat_dim"]) == (1, 256, 2560)
    assert rp.transformer_config("flux2_klein_9b")["num_attention_heads"] == 32


def test_materialise_initialises_parameters_and_keeps_buffers():
    model = rte.materialise_(
        rp.empty_transformer("wan21_1_3b", layers=1), torch.device("cpu"), torch.bfloat16, 0
    )
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params.values())
    assert torch.count_nonzero(params["blocks.0.attn1.to_q.bias"]) == 0
    assert torch.all(params["blocks.0.attn1.norm_q.weight"] == 1)
    assert params["blocks.0.ffn.net.0.proj.weight"].float().std().item() == pytest.approx(
        rte.INIT_STD, rel=0.02
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


@pytest.fixture
def small_qwen_image21_vae(monkeypatch):
    """Qwen-Image 2.1's VAE (338 M parameters) takes ~10 s to initialise and ~15 s to decode on 2
    CPU cores; its architecture is counted above. Here it is the tiny builder's (the same class,
    narrow, still 16x and 64 channels): the pipeline, adapter and save path are what is tested."""
    monkeypatch.setattr(
        rp,
        "QWEN_IMAGE21_VAE",
        dict(base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1),
    )


@pytest.mark.parametrize("family", sorted(BUILT_FAMILIES))
def test_family_builds_checks_saves_and_loads(
    family, tmp_path, small_condition_resize, small_qwen_image21_vae
):
    from diffrl.models import load_model

    summary = rp.write(family, tmp_path / family, "cpu", layers=1)
    expected = rp.plan(family, 1)["params"]
    assert summary["transformer_params"] == expected
    if family in EDIT_FAMILIES:
        assert expected == _layer_scaled_params(family, 1)
        assert summary["sanity"]["condition_tokens"] == 16
    else:
        # two heads of 128 wide, the text width the real text encoder gives
        assert rp.transformer_config(family, 1).get("num_attention_heads", 2) == 2
    assert all(v == v and abs(v) < 1e4 for v in summary["sanity"].values())  # finite

    index = json.loads((tmp_path / family / "model_index.json").read_text())
    assert index["_class_name"] == BUILT_FAMILIES[family]
    adapter = load_model(tmp_path / family, "bfloat16", "cpu")
    assert adapter.pipeline_class_name == BUILT_FAMILIES[family]
    assert sum(p.numel() for p in adapter.transformer.parameters()) == expected
    if family in rp.TEXT_ENCODERS:
        text_encoder = adapter.pipe.text_encoder
        assert type(text_encoder).__name__ == rp.TEXT_ENCODERS[family].model_class
        assert sum(p.numel() for p in text_encoder.parameters()) == summary["text_encoder_params"]
    if family == "flux2_klein_4b":
        assert index["is_distilled"] is True  # FLUX.2-klein-4B is step-distilled: no CFG
    if family == "qwen_image21":
        assert index["processor"] == ["transformers", "Qwen3VLProcessor"]
    if family == "qwen_image_edit":
        # The processor is saved under the real class and makes the real model's image tokens: a
        # 1024² condition image (the pipeline's resize) is 74 x 74 patches of 14 pixels (sides
        # rounded to multiples of 28), 37 x 37 = 1,369 tokens after the 2x2 merge.
        assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
        processor = adapter.pipe.processor
        grid = processor(text=["<|image_pad|>"], images=[rp.condition_image(1024, 1024)], return_tensors="pt")
        assert grid["image_grid_thw"].tolist() == [[1, 74, 74]]
    # the saved directory samples through diffrl as the built pipeline did
    assert rp.sanity_check(adapter.pipe, "cpu")["velocity_std"] == pytest.approx(
        summary["sanity"]["velocity_std"], rel=1e-2
    )
