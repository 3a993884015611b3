"""Write a full-size pipeline with random weights to a directory, for GPU runs of `diffrl train`.

Families (the transformer and VAE have the real architecture; the text encoders of these seven
keep the real output widths, which is what the transformer consumes, but have one small layer, and the
tokenizers are diffrl's tiny offline ones: prompt encoding runs once per prompt, so its cost is not
what a training step measures):

    flux_dev     FLUX.1-dev: FluxTransformer2DModel 11.90 B (19 double + 38 single blocks, 24 x 128,
                 guidance embedding), the FLUX AutoencoderKL (16 channels), CLIP-L (768 pooled) and
                 T5 (4096) text encoders                                        ~24 GB on disk
    qwen_image   Qwen-Image: QwenImageTransformer2DModel 20.43 B (60 blocks, 24 x 128),
                 AutoencoderKLQwenImage, Qwen2.5-VL text encoder of width 3584   ~41 GB on disk
    wan21_1_3b   Wan2.1-T2V-1.3B: WanTransformer3DModel 1.42 B (30 blocks, 12 x 128, ffn 8960),
                 AutoencoderKLWan (fp32), UMT5 text encoder of width 4096       ~3.4 GB on disk
    wan21_14b    Wan2.1-T2V-14B: 14.29 B (40 blocks, 40 x 128, ffn 13824)       ~29 GB on disk
    wan22_a14b   Wan2.2-T2V-A14B: two experts of wan21_14b's architecture (transformer, the
                 high-noise one, and transformer_2) switched at boundary_ratio 0.875; on disk
                 transformer_2 is a link to transformer (random weights either way; one copy of
                 ~29 GB on a 64 GB disk), loaded as two modules of 14.29 B each   ~29 GB on disk
    flux_kontext FLUX.1-Kontext-dev (FluxKontextPipeline): flux_dev's components ~24 GB on disk
    qwen_image_edit
                 Qwen-Image-Edit (QwenImageEditPipeline): qwen_image's components plus the
                 Qwen2.5-VL processor (its real image processor: 14-pixel patches, 2x2 merge, up
                 to 12.8 M pixels, so a 1024² condition image is 1,369 text tokens, as in the real
                 model); the text encoder's vision tower has one small block projecting to the
                 text width 3584                                                ~41 GB on disk

The 2026 families (issue 49) are built with their text encoders at full size too (random weights,
the published configs, drawn on `--device` as the transformer), so that a run's memory is the real
model's; their tokenizers are still the tiny offline ones of their adapters' tiny builders:

    flux2_klein_4b  FLUX.2 [klein] 4B (Flux2KleinPipeline, step-distilled): Flux2Transformer2DModel
                    3.88 B (5 double + 20 single blocks, 24 x 128), AutoencoderKLFlux2, Qwen3-4B
                    (4.02 B)                                                    ~16 GB on disk
    flux2_klein_9b  FLUX.2 [klein] 9B: 9.08 B (8 + 24 blocks, 32 x 128), Qwen3-8B (8.19 B) ~35 GB
    flux2_dev       FLUX.2 [dev] (Flux2Pipeline): 32.22 B (8 + 48 blocks, 48 x 128, guidance
                    embedding), Mistral-Small-3.2-24B with its Pixtral tower (24.01 B)  ~113 GB
    zimage_turbo    Z-Image-Turbo (ZImagePipeline): ZImageTransformer2DModel 6.15 B (30 layers +
                    2 + 2 refiners, 3840 = 30 x 128), FLUX.1's VAE, Qwen3-4B's base model ~21 GB
    qwen_image21    Qwen-Image 2.1 (QwenImage21Pipeline): QwenImage21Transformer2DModel 7.12 B (32
                    single-stream blocks, 32 x 128), AutoencoderKLQwenImage21 (64 channels, RGBA),
                    Qwen3-VL-8B with its vision tower (8.77 B)                  ~33 GB on disk

Under `--layers` these run two heads wide (`Family.narrow`) with text encoders of their real
width holding only the layers the pipeline reads (`TextEncoder.small_text`).

The transformer is never materialised in fp32 on the host: it is built with empty (meta)
parameters, then each parameter is allocated in bf16 on `--device` and drawn from a seeded
N(0, 0.02) (biases 0, norm weights 1). diffusers' transformers define no weight init of their own,
and this scale keeps a forward finite and O(1) at full depth; the script checks that with one
forward and one VAE decode through diffrl's own adapter before writing. The directory is written
with `save_pretrained` (safetensors, bf16) into a staging folder renamed at the end, so a partly
written model is never taken for a complete one. The edit families' check conditions its prompt on a
generated picture (`condition_image`), which the adapter resizes to about one megapixel, as the
pipelines do.

    python benchmarks/random_pipelines.py flux_dev /tmp/diffrl_random/flux_dev          # on the GPU
    python benchmarks/random_pipelines.py qwen_image /tmp/qi --layers 1 --device cpu    # CPU smoke
    python benchmarks/random_pipelines.py wan21_14b --plan                              # sizes only
    python benchmarks/random_pipelines.py qwen_image_edit /tmp/qie --device cuda        # an edit family
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights

sys.path.insert(0, str(Path(__file__).parent))
from random_text_encoders import (
    MISTRAL_SMALL_3_VISION,
    TEXT_ENCODERS,
    materialise_,
    random_text_encoder,
    text_encoder_plan,
)
from rollout import SD3_VAE

#: Std of the random weights (GPT-2's / BERT's initializer range).
GB = 1e9

# ---------------------------------------------------------------------------------- real configs
# FLUX.1-dev transformer: black-forest-labs/FLUX.1-dev transformer/config.json. The same numbers
# are BFL's `flux-dev` params in the reference repo (src/flux/util.py: depth 19, depth_single_blocks
# 38, hidden 3072 = 24 heads x 128, context_in_dim 4096, vec_in_dim 768, axes_dim [16, 56, 56],
# guidance_embed True) and diffusers' FluxTransformer2DModel defaults, except guidance_embeds,
# which only FLUX.1-dev has (schnell is not guidance-distilled).
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,  # 16 VAE channels x 2 x 2 packing
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,  # T5-XXL width
    pooled_projection_dim=768,  # CLIP-L pooled width
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# FLUX.1-dev vae/config.json: BFL's ae_params (ch 128, ch_mult [1, 2, 4, 4], num_res_blocks 2,
# z_channels 16, scale_factor 0.3611, shift_factor 0.1159) in diffusers' AutoencoderKL terms; the
# BFL autoencoder has no quant convs. 83,819,683 parameters.
# The SD3 VAE's architecture (benchmarks/rollout.py) with FLUX's latent scale and shift.
FLUX_VAE = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# Qwen/Qwen-Image transformer/config.json (= diffusers' QwenImageTransformer2DModel defaults).
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,  # Qwen2.5-VL-7B's hidden size
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
# Qwen/Qwen-Image vae/config.json (= AutoencoderKLQwenImage's defaults, latents_mean/std included).
QWEN_IMAGE_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
)
# diffusers scripts/convert_wan_to_diffusers.py, get_transformer_config("Wan-T2V-1.3B") and
# ("Wan-T2V-14B"); the same sizes as Wan's own configs (wan/configs/wan_t2v_1_3B.py: dim 1536 =
# 12 x 128, ffn_dim 8960, 30 layers; wan_t2v_14B.py: dim 5120 = 40 x 128, ffn_dim 13824, 40 layers).
_WAN_COMMON = dict(
    patch_size=(1, 2, 2),
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,  # UMT5-XXL width
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
)
WAN21_1_3B_TRANSFORMER = dict(**_WAN_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN21_14B_TRANSFORMER = dict(**_WAN_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# The conversion script builds the VAE as `AutoencoderKLWan()`: its defaults are Wan2.1's VAE
# (base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], latents_mean/std). 126,892,531 parameters.
WAN_VAE: dict = {}
# Wan2.1's scheduler flow_shift (3.0 for 480p); the conversion script writes
# FlowMatchEulerDiscreteScheduler(shift=3.0), which is also what diffrl samples.
WAN_SHIFT = 3.0
# Qwen2.5-VL's image processor, as the Qwen2-VL / Qwen2.5-VL checkpoints' preprocessor_config.json
# sets it (Qwen-Image-Edit's processor/ folder has the same 12.8 M-pixel budget): 14-pixel patches, 2
# frames per temporal patch, 2x2 merge, 56² to 12,845,056 pixels; the vision tower's patch sizes are
# its config defaults, the same numbers.
QWEN_VL_IMAGE_PROCESSOR = dict(
    min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2
)


# FLUX.2 [klein] 4B / 9B and FLUX.2 [dev]: black-forest-labs/FLUX.2-klein-4B, -9B and FLUX.2-dev
# transformer/config.json. diffusers' Flux2Transformer2DModel defaults are FLUX.2 [dev]'s (8 double
# + 48 single blocks, 48 x 128, text 15360 = 3 x Mistral-Small's 5120, guidance embedding); [klein]
# has no guidance embedding and reads 3 x its Qwen3's width (layers 9, 18, 27 stacked).
FLUX2_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,  # 32 VAE channels x 2 x 2 patchified
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
FLUX2_KLEIN_4B_TRANSFORMER = {
    **FLUX2_DEV_TRANSFORMER,
    **dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
    "guidance_embeds": False,
}
FLUX2_KLEIN_9B_TRANSFORMER = {
    **FLUX2_KLEIN_4B_TRANSFORMER,
    **dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
}
# The FLUX.2 VAE (vae/config.json of every FLUX.2 checkpoint) is AutoencoderKLFlux2's defaults: 32
# latent channels, 8x, batch-norm statistics over the 2x2-patchified latents. 84,046,115 parameters.
FLUX2_VAE: dict = {}
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (Z-Image, the base model, has the same one).
ZIMAGE_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,  # each of the noise and the context refiner
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,  # Qwen3-4B's hidden size
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)
# Z-Image's VAE is FLUX.1's (vae/config.json: scaling 0.3611, shift 0.1159).
ZIMAGE_VAE = FLUX_VAE
# Qwen/Qwen-Image-2.1 transformer/config.json = QwenImage21Transformer2DModel's defaults: 32
# single-stream blocks of 32 x 128, SwiGLU 3 x 4096, 64 latent channels unpatched, text 4096
# (Qwen3-VL-8B's width), RoPE axes (16, 56, 56), causal_condition.
QWEN_IMAGE21_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=32,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    eps=1e-6,
    causal_condition=True,
)
# AutoencoderKLQwenImage21's defaults (Wan2.2-style: base 96 / decoder 144, dim_mult [1, 2, 4, 8,
# 8], 16x, 64 latent channels, RGBA out).
QWEN_IMAGE21_VAE: dict = {}


@dataclass(frozen=True)
class Family:
    transformer_class: str
    transformer_config: dict
    #: config keys that count repeated blocks (`--layers` caps each of them)
    layer_keys: tuple[str, ...]
    #: the transformer's parameter count in the published checkpoint (safetensors metadata)
    published_params: int
    source: str
    #: config changes under `--layers` besides the caps: the 2026 families run their CPU smoke
    #: runs two heads wide (the width their RoPE and text input need stays), which a one-block
    #: model of 3,000-4,000 channels would not make a smoke run
    narrow: dict = dataclasses.field(default_factory=dict)


#: Two heads of 128 (the head width the RoPE axes sum to).
_TWO_HEADS = {"num_attention_heads": 2}

FAMILIES: dict[str, Family] = {
    "flux_dev": Family(
        "FluxTransformer2DModel",
        FLUX_DEV_TRANSFORMER,
        ("num_layers", "num_single_layers"),
        11_901_408_320,
        "black-forest-labs/FLUX.1-dev transformer (safetensors total, '11.9B' on the model card)",
    ),
    "qwen_image": Family(
        "QwenImageTransformer2DModel",
        QWEN_IMAGE_TRANSFORMER,
        ("num_layers",),
        20_430_401_088,
        "Qwen/Qwen-Image transformer (safetensors total, the '20B MMDiT')",
    ),
    "wan21_1_3b": Family(
        "WanTransformer3DModel",
        WAN21_1_3B_TRANSFORMER,
        ("num_layers",),
        1_418_996_800,
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer (safetensors total)",
    ),
    "wan21_14b": Family(
        "WanTransformer3DModel",
        WAN21_14B_TRANSFORMER,
        ("num_layers",),
        14_288_491_584,
        "Wan-AI/Wan2.1-T2V-14B-Diffusers transformer (safetensors total; each Wan2.2-A14B expert too)",
    ),
    # Wan2.2-T2V-A14B: each expert is Wan2.1-14B's architecture (Wan's wan_t2v_A14B config: dim
    # 5120, ffn 13824, 40 layers, 40 heads), hence "A14B": 14 B active of 27 B.
    "wan22_a14b": Family(
        "WanTransformer3DModel",
        WAN21_14B_TRANSFORMER,
        ("num_layers",),
        14_288_491_584,
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers, each of transformer/ and transformer_2/ (Wan2.1-14B's architecture)",
    ),
    # The edit models are their text-to-image base's transformer fine-tuned: the same architecture,
    # so the base's count. Derived, not read from their own safetensors metadata: the Hub lists
    # FLUX.1-Kontext-dev's transformer as 23.8 GB in shards of 9.98 / 9.95 / 3.87 GB (FLUX.1-dev's
    # exactly) and Qwen-Image-Edit's as 40.9 GB (Qwen-Image's); 2 bytes x the counts below.
    "flux_kontext": Family(
        "FluxTransformer2DModel",
        FLUX_DEV_TRANSFORMER,
        ("num_layers", "num_single_layers"),
        11_901_408_320,
        "black-forest-labs/FLUX.1-Kontext-dev transformer: FLUX.1-dev's architecture and count "
        "(derived; the Hub's 23.8 GB of bf16 shards agree)",
    ),
    "qwen_image_edit": Family(
        "QwenImageTransformer2DModel",
        QWEN_IMAGE_TRANSFORMER,
        ("num_layers",),
        20_430_401_088,
        "Qwen/Qwen-Image-Edit transformer: Qwen-Image's architecture and count "
        "(derived; the Hub's 40.9 GB of bf16 shards agree)",
    ),
    "flux2_klein_4b": Family(
        "Flux2Transformer2DModel",
        FLUX2_KLEIN_4B_TRANSFORMER,
        ("num_layers", "num_single_layers"),
        3_875_544_576,
        "black-forest-labs/FLUX.2-klein-4B transformer ('4B'; its config built by diffusers)",
        _TWO_HEADS,
    ),
    "flux2_klein_9b": Family(
        "Flux2Transformer2DModel",
        FLUX2_KLEIN_9B_TRANSFORMER,
        ("num_layers", "num_single_layers"),
        9_078_581_248,
        "black-forest-labs/FLUX.2-klein-9B transformer ('9B'; its config built by diffusers)",
        _TWO_HEADS,
    ),
    "flux2_dev": Family(
        "Flux2Transformer2DModel",
        FLUX2_DEV_TRANSFORMER,
        ("num_layers", "num_single_layers"),
        32_223_281_152,
        "black-forest-labs/FLUX.2-dev transformer ('32B'; diffusers' Flux2Transformer2DModel defaults)",
        _TWO_HEADS,
    ),
    "zimage_turbo": Family(
        "ZImageTransformer2DModel",
        ZIMAGE_TRANSFORMER,
        ("n_layers", "n_refiner_layers"),
        6_154_908_736,
        "Tongyi-MAI/Z-Image-Turbo transformer (safetensors total, '6B')",
        {"dim": 256, "n_heads": 2, "n_kv_heads": 2},
    ),
    "qwen_image21": Family(
        "QwenImage21Transformer2DModel",
        QWEN_IMAGE21_TRANSFORMER,
        ("num_layers",),
        7_115_124_736,
        "Qwen/Qwen-Image-2.1 transformer (safetensors total, BF16, '7B')",
        _TWO_HEADS,
    ),
}


def transformer_config(family: str, layers: int | None = None) -> dict:
    """The family's real transformer config; `layers` caps every block stack (CPU smoke runs) and
    applies the family's `narrow` changes."""
    spec = _family(family)
    config = dict(spec.transformer_config)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        for key in spec.layer_keys:
            config[key] = min(layers, config[key])
        config.update(spec.narrow)
    return config


def _family(family: str) -> Family:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[family]


def empty_transformer(family: str, layers: int | None = None) -> torch.nn.Module:
    """The transformer with meta parameters (no memory); buffers such as RoPE tables are real."""
    import diffusers

    cls = getattr(diffusers, _family(family).transformer_class)
    with init_empty_weights():
        return cls(**transformer_config(family, layers))


def plan(family: str, layers: int | None = None) -> dict:
    """Parameter count and bf16 weight bytes of the family's transformer, from the meta model."""
    model = empty_transformer(family, layers)
    params = sum(p.numel() for p in model.parameters())
    spec = _family(family)
    return {
        "bench": "random_pipelines.plan",
        "family": family,
        "transformer": spec.transformer_class,
        "config": transformer_config(family, layers),
        "params": params,
        "published_params": spec.published_params if layers is None else None,
        "published_source": spec.source,
        "bf16_weight_gb": 2 * params / GB,
        "bf16_weight_gib": 2 * params / 2**30,
        **text_encoder_plan(family, layers),
    }


# ---------------------------------------------------------------------------------- components
def _flux_pipeline(transformer, pipeline_class: str = "FluxPipeline"):
    """FLUX.1-dev's components; `pipeline_class` FluxKontextPipeline takes the same ones (its
    optional IP-adapter image encoder left out)."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffrl.models import tiny_text
    from diffrl.models.flux import FLUX_DEV_SCHEDULER_CONFIG

    clip_tok, t5_tok = tiny_text.clip_tokenizer(), tiny_text.t5_tokenizer()
    # CLIP-L's width (768, the pooled vector the transformer takes) with one layer; T5 with the
    # T5-XXL width 4096 (the transformer's context input) and one small layer.
    clip = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=768,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=12,
            max_position_embeddings=clip_tok.model_max_length,
            projection_dim=768,
            **tiny_text.text_encoder_ids(clip_tok),
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            d_model=4096,
            d_kv=64,
            d_ff=256,
            num_layers=1,
            num_heads=2,
            feed_forward_proj="gated-gelu",  # T5 v1.1, as T5-XXL
            decoder_start_token_id=t5_tok.pad_token_id,
            **tiny_text.text_encoder_ids(t5_tok),
        )
    )
    return getattr(diffusers, pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG),
        vae=AutoencoderKL(**FLUX_VAE),
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def _qwen_image_pipeline(transformer, edit: bool = False):
    """Qwen-Image's components; with `edit`, QwenImageEditPipeline's: the same plus the processor
    that turns the condition image into the text encoder's image tokens."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from diffrl.models.qwen_image_edit import TINY_EDIT_VOCAB_SIZE, ImageOnlyQwen2VLProcessor
    from diffrl.models.qwen_image_tiny import QWEN_IMAGE_SCHEDULER_CONFIG, tiny_qwen2_tokenizer

    # QwenImagePipeline (text-to-image) needs a Qwen2.5-VL text encoder and a Qwen2 tokenizer, no
    # processor (only the edit pipelines take images). The template and its prefix length live on
    # the pipeline instance, so the tokenizer is built after it (the edit template's longer prefix
    # needs a larger tiny vocabulary to be its 64 tokens).
    pipe = (QwenImageEditPipeline if edit else QwenImagePipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=AutoencoderKLQwenImage(**QWEN_IMAGE_VAE),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        **({"processor": None} if edit else {}),
    )
    tokenizer = tiny_qwen2_tokenizer(
        pipe.prompt_template_encode,
        pipe.prompt_template_encode_start_idx,
        **({"vocab_size": TINY_EDIT_VOCAB_SIZE} if edit else {}),
    )
    ids = tokenizer.convert_tokens_to_ids
    # Qwen2.5-VL-7B-Instruct's text width and attention shape (hidden 3584 = 28 heads x 128, 4 KV
    # heads, mrope_section [16, 24, 24], rope_theta 1e6: its config.json), one layer with a small
    # MLP; a one-block vision tower (the real one: 32 blocks of width 1280) projecting to 3584,
    # the text width its image tokens enter the text model at. Only the edit pipelines run it.
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 3584,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 3584,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    processor = {}
    if edit:
        # Without the video part, which needs torchvision (diffrl.models.qwen_image_edit); saved
        # under the real class's name (save_pipeline).
        image_processor = Qwen2VLImageProcessor(**QWEN_VL_IMAGE_PROCESSOR)
        processor["processor"] = ImageOnlyQwen2VLProcessor(
            image_processor=image_processor, tokenizer=tokenizer
        )
    pipe.register_modules(
        text_encoder=Qwen2_5_VLForConditionalGeneration(config), tokenizer=tokenizer, **processor
    )
    return pipe


def _wan_pipeline(transformer):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from diffrl.models.tiny_text import t5_tokenizer, text_encoder_ids

    tokenizer = t5_tokenizer()
    # UMT5-XXL's width 4096 (the transformer's text_dim) with one small layer.
    umt5 = UMT5EncoderModel(
        UMT5Config(
            d_model=4096,
            d_kv=64,
            d_ff=256,
            num_layers=1,
            num_heads=2,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            decoder_start_token_id=tokenizer.pad_token_id,
            **text_encoder_ids(tokenizer),
        )
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5,
        vae=AutoencoderKLWan(**WAN_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN_SHIFT),
        transformer=transformer,
    )


def _vocab(tokenizer, layers: int | None) -> dict:
    """The text model's vocabulary: the published size at full size (the count is the published
    one; the tiny tokenizer's ids are a subset), the tokenizer's own under `--layers`."""
    return {} if layers is None else {"vocab_size": len(tokenizer)}


def _flux2_pipeline(transformer, family: str, device, layers: int | None, seed: int):
    """FLUX.2 [klein] (`Flux2KleinPipeline`, step-distilled as FLUX.2-klein-4B/9B: is_distilled) or
    [dev] (`Flux2Pipeline`, Mistral-Small-3 behind a Pixtral processor)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    from diffrl.models.flux2 import FLUX2_SCHEDULER_CONFIG

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG)
    vae = AutoencoderKLFlux2(**FLUX2_VAE)
    if family != "flux2_dev":
        from diffusers import Flux2KleinPipeline

        from diffrl.models.zimage import tiny_qwen3_tokenizer

        tokenizer = tiny_qwen3_tokenizer()
        ids = tokenizer.convert_tokens_to_ids
        text = {
            **_vocab(tokenizer, layers),
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        }
        return Flux2KleinPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=random_text_encoder(family, device, layers, seed, text),
            tokenizer=tokenizer,
            transformer=transformer,
            is_distilled=True,
        )
    from diffusers import Flux2Pipeline
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from diffrl.models.flux2_dev import TINY_CHAT_TEMPLATE, PixtralTextProcessor, tiny_mistral_tokenizer

    vision = MISTRAL_SMALL_3_VISION
    patch, merge = vision["patch_size"], TEXT_ENCODERS[family].extra["spatial_merge_size"]
    tokenizer = tiny_mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    image_processor = PixtralImageProcessorPil(
        patch_size=patch, size={"longest_edge": vision["image_size"]}
    ).to_dict()
    processor = PixtralTextProcessor(
        tokenizer=tokenizer,
        chat_template=TINY_CHAT_TEMPLATE,
        patch_size=patch,
        spatial_merge_size=merge,
        image_processor=image_processor,
    )
    text = {
        **_vocab(tokenizer, layers),
        "bos_token_id": ids("<s>"),
        "eos_token_id": ids("</s>"),
        "pad_token_id": ids("<pad>"),
    }
    top = {"image_token_index": ids("[IMG]")}
    return Flux2Pipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=random_text_encoder(family, device, layers, seed, text, top),
        tokenizer=processor,
        transformer=transformer,
    )


def _zimage_pipeline(transformer, family: str, device, layers: int | None, seed: int):
    """Z-Image-Turbo (`ZImagePipeline`): Qwen3-4B's base model, FLUX.1's VAE, the Turbo scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from diffrl.models.zimage import ZIMAGE_TURBO_SCHEDULER_CONFIG, tiny_qwen3_tokenizer

    tokenizer = tiny_qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text = {
        **_vocab(tokenizer, layers),
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_TURBO_SCHEDULER_CONFIG),
        vae=AutoencoderKL(**ZIMAGE_VAE),
        text_encoder=random_text_encoder(family, device, layers, seed, text),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _qwen_image21_pipeline(transformer, family: str, device, layers: int | None, seed: int):
    """Qwen-Image 2.1 (`QwenImage21Pipeline`): Qwen3-VL-8B behind the text side of a Qwen3-VL
    processor (diffrl's `Qwen3VLTextProcessor`, the tiny builder's tokenizer and chat template; saved
    as the real `Qwen3VLProcessor` by `_before_save`), the 64-channel RGBA VAE."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    from diffrl.models.qwen_image21 import Qwen3VLTextProcessor
    from diffrl.models.qwen_image21_tiny import (
        _T2I_TEMPLATE,
        QWEN3_VL_CHAT_TEMPLATE,
        QWEN_IMAGE21_SCHEDULER_CONFIG,
    )
    from diffrl.models.qwen_image_tiny import tiny_qwen2_tokenizer

    tokenizer = tiny_qwen2_tokenizer(_T2I_TEMPLATE, None)
    ids = tokenizer.convert_tokens_to_ids
    text = {**_vocab(tokenizer, layers), "pad_token_id": ids("<|endoftext|>")}
    top = {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE21_SCHEDULER_CONFIG),
        vae=AutoencoderKLQwenImage21(**QWEN_IMAGE21_VAE),
        text_encoder=random_text_encoder(family, device, layers, seed, text, top),
        processor=Qwen3VLTextProcessor(tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE),
        transformer=transformer,
    )


#: Families whose builder makes its own full-size text encoder on the device:
#: builder(transformer, family, device, layers, seed).
_FULL_TEXT_PIPELINES = {
    "flux2_klein_4b": _flux2_pipeline,
    "flux2_klein_9b": _flux2_pipeline,
    "flux2_dev": _flux2_pipeline,
    "zimage_turbo": _zimage_pipeline,
    "qwen_image21": _qwen_image21_pipeline,
}

_PIPELINES = {
    "flux_dev": _flux_pipeline,
    "qwen_image": _qwen_image_pipeline,
    "wan21_1_3b": _wan_pipeline,
    "wan21_14b": _wan_pipeline,
    "wan22_a14b": _wan_pipeline,
    "flux_kontext": functools.partial(_flux_pipeline, pipeline_class="FluxKontextPipeline"),
    "qwen_image_edit": functools.partial(_qwen_image_pipeline, edit=True),
}


def build_pipeline(family: str, device: torch.device, layers: int | None = None, seed: int = 0):
    """The random pipeline on `device`, every component in bf16 except where diffrl's adapter loads a
    component in a dtype of its own (Wan's VAE in fp32)."""
    from diffrl.models import adapter_class

    device = torch.device(device)
    transformer = materialise_(empty_transformer(family, layers), device, torch.bfloat16, seed)
    # The small components (VAE, one-layer text encoders: < 0.4 B parameters) use their libraries'
    # own initialisation, on the host in fp32, then move; the full-size text encoders of the 2026
    # families are materialised on the device as the transformer.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family in _FULL_TEXT_PIPELINES:
            # the text encoder is drawn like the transformer (another seed), on the device
            pipe = _FULL_TEXT_PIPELINES[family](transformer.eval(), family, device, layers, seed + 1)
        else:
            pipe = _PIPELINES[family](transformer.eval())
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name != "transformer":
            component.to(device, torch.bfloat16).eval()
    for name, dtype in adapter_class(type(pipe).__name__).component_dtypes.items():
        getattr(pipe, name).to(dtype)
    return pipe


def condition_image(width: int, height: int, seed: int = 0):
    """A smooth random RGB picture (colour ramps plus a little noise) to condition an edit on."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.random(3) + np.linspace(0, 1, height)[:, None, None]
    pixels = ramp / ramp.max() * 200 + rng.random((height, width, 3)) * 55
    return Image.fromarray(pixels.astype(np.uint8))


#: The sanity check's text length where 16 tokens do not hold its prompt and template.
SANITY_TEXT_TOKENS = {"Flux2Pipeline": 64, "QwenImage21Pipeline": 64}


def sanity_check(pipe, device: torch.device) -> dict:
    """One prompt through diffrl's adapter at 64x64 (one frame): encode, one velocity, decode. An
    edit family's prompt comes with its condition image(s) (`condition_image`, 64x64, resized by
    the adapter as by the pipeline: about one megapixel).

    Raises if the velocity or the pixels are not finite; returns their statistics.
    """
    from diffrl.models import adapter_class

    adapter = adapter_class(type(pipe).__name__)(pipe, torch.device(device), torch.bfloat16)
    size = 64
    # FLUX.2 [dev]'s system message is 32 tokens of its own; Qwen-Image 2.1 does not truncate
    text_tokens = SANITY_TEXT_TOKENS.get(type(pipe).__name__, 16)
    prompts = ["a red circle left of a blue square"]
    rule = adapter.condition_rule
    with torch.no_grad():
        if rule is None:
            cond = adapter.encode_prompts(prompts, None, text_tokens)
        else:
            images = [[condition_image(size, size, seed) for seed in range(rule.min_images)]]
            cond = adapter.encode_conditioned(prompts, None, text_tokens, images)
        generator = torch.Generator(device=device).manual_seed(0)
        latents = adapter.init_noise([generator], size, size)
        velocity = adapter.velocity(latents, torch.tensor([500.0]), cond, 3.5, size, size)
        pixels = adapter.decode(latents - 0.5 * velocity, size, size)
    if not torch.isfinite(velocity).all():
        raise RuntimeError("the random transformer's velocity is not finite: the init scale is wrong")
    stats = {
        "velocity_std": velocity.std().item(),
        "velocity_abs_max": velocity.abs().max().item(),
        "pixel_mean": pixels.float().mean().item(),
    }
    if rule is not None:
        stats["condition_tokens"] = cond.cond_latents.shape[1]
    return stats


#: Families written with a second expert (transformer_2 and boundary_ratio in model_index.json).
TWO_EXPERTS = {"wan22_a14b": 0.875}  # Wan2.2-T2V-A14B's boundary_ratio


def add_second_expert(folder: Path, boundary_ratio: float = TWO_EXPERTS["wan22_a14b"]) -> None:
    """Make a saved one-transformer Wan pipeline a two-expert one: `transformer_2` links to
    `transformer` (relative link: random weights either way, one copy on disk) and
    model_index.json names it and the boundary, as Wan2.2-T2V-A14B-Diffusers' does."""
    folder = Path(folder)
    (folder / "transformer_2").symlink_to("transformer", target_is_directory=True)
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer_2"] = index["transformer"]
    index["boundary_ratio"] = boundary_ratio
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _report_progress(path: Path, expected: float, done: threading.Event, every_s: float) -> None:
    start = time.perf_counter()
    while not done.wait(every_s):
        written = _dir_bytes(path) / GB
        elapsed = time.perf_counter() - start
        print(f"  ... {written:.1f} / ~{expected:.1f} GB written ({elapsed:.0f} s)", flush=True)


def _save(family: str, pipe, folder: Path) -> None:
    """`save_pretrained`, each processor under the class its folder loads as: an edit pipeline's
    (`qwen_image_edit.save_pipeline`), FLUX.2 [dev]'s text-only Pixtral processor as a
    `PixtralProcessor` and Qwen-Image 2.1's as a full `Qwen3VLProcessor` (as their tiny builders
    write them; diffrl loads both folders text-only again)."""
    from diffrl.models.qwen_image_edit import save_pipeline

    if family == "qwen_image21":
        from diffrl.models.qwen_image21_tiny import _full_processor

        text_processor = pipe.processor
        pipe.register_modules(processor=_full_processor(text_processor))
        try:
            save_pipeline(pipe, folder)
        finally:
            pipe.register_modules(processor=text_processor)
        return
    save_pipeline(pipe, folder)
    if family == "flux2_dev":
        index_file = Path(folder) / "model_index.json"
        index = json.loads(index_file.read_text())
        index["tokenizer"] = ["transformers", "PixtralProcessor"]
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write(family: str, out: Path, device: str, layers: int | None = None, seed: int = 0) -> dict:
    """Build, check and save the pipeline at `out` (which must not exist); returns a summary."""
    out = Path(out)
    if (out / "model_index.json").exists():
        raise FileExistsError(f"{out} already holds a pipeline: remove it first or pick another OUT")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pick an empty or new directory")
    info = plan(family, layers)
    print(
        f"{family}: transformer {info['params'] / 1e9:.2f} B parameters, "
        f"{info['bf16_weight_gb']:.1f} GB in bf16; building on {device}",
        flush=True,
    )
    start = time.perf_counter()
    pipe = build_pipeline(family, torch.device(device), layers, seed)
    built_s = time.perf_counter() - start
    print(f"  built in {built_s:.1f} s; checking one forward and one decode", flush=True)
    check = sanity_check(pipe, torch.device(device))
    print(f"  sanity: {json.dumps(check)}", flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    expected = sum(
        p.numel() * p.element_size()
        for c in pipe.components.values()
        if isinstance(c, torch.nn.Module)
        for p in c.parameters()
    )
    print(f"  writing ~{expected / GB:.1f} GB to {out}", flush=True)
    done = threading.Event()
    reporter = threading.Thread(
        target=_report_progress, args=(staging, expected / GB, done, 15.0), daemon=True
    )
    reporter.start()
    start = time.perf_counter()
    try:
        _save(family, pipe, staging)  # safetensors; processors by their real classes
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        done.set()
        reporter.join(timeout=5)
    saved_s = time.perf_counter() - start
    if family in TWO_EXPERTS:
        add_second_expert(staging)
    if out.exists():
        out.rmdir()  # empty, checked above
    staging.rename(out)
    size = _dir_bytes(out)
    print(
        f"  wrote {size / GB:.1f} GB in {saved_s:.1f} s ({size / GB / max(saved_s, 1e-9):.2f} GB/s)",
        flush=True,
    )
    return {
        "bench": "random_pipelines",
        "family": family,
        "out": str(out),
        "device": str(device),
        "transformer_params": info["params"],
        **({"text_encoder_params": _params(pipe.text_encoder)} if family in TEXT_ENCODERS else {}),
        "layers": {k: info["config"][k] for k in _family(family).layer_keys},
        "disk_gb": size / GB,
        "build_s": built_s,
        "save_s": saved_s,
        "sanity": check,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("family", choices=list(FAMILIES))
    parser.add_argument("out", type=Path, nargs="?", help="the directory to write (omit with --plan)")
    parser.add_argument("--layers", type=int, default=None, help="cap every block stack (CPU smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", action="store_true", help="print sizes from the meta model, write nothing")
    args = parser.parse_args(argv)
    if args.plan:
        print(json.dumps(plan(args.family, args.layers)))
        return
    if args.out is None:
        parser.error("OUT is required unless --plan")
    try:
        print(json.dumps(write(args.family, args.out, args.device, args.layers, args.seed)))
    except (FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
