"""Write a full-size pipeline with random weights to a directory, for GPU runs of `diffrl train`.

Families (the transformer and VAE have the real architecture; the text encoders keep the real
output widths, which is what the transformer consumes, but have one small layer, and the
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
from rollout import SD3_VAE

#: Std of the random weights (GPT-2's / BERT's initializer range).
INIT_STD = 0.02
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


@dataclass(frozen=True)
class Family:
    transformer_class: str
    transformer_config: dict
    #: config keys that count repeated blocks (`--layers` caps each of them)
    layer_keys: tuple[str, ...]
    #: the transformer's parameter count in the published checkpoint (safetensors metadata)
    published_params: int
    source: str


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
}


def transformer_config(family: str, layers: int | None = None) -> dict:
    """The family's real transformer config; `layers` caps every block stack (CPU smoke runs)."""
    spec = _family(family)
    config = dict(spec.transformer_config)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        for key in spec.layer_keys:
            config[key] = min(layers, config[key])
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


def materialise_(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """Give every meta parameter real storage in `dtype` on `device`, drawn from a seeded init.

    Biases 0, the weights of normalisation layers 1, everything else N(0, INIT_STD): one tensor at a
    time, so the host never holds the model.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, param in list(module.named_parameters(recurse=False)):
            data = torch.empty(param.shape, device=device, dtype=dtype)
            if name.endswith("bias"):
                data.zero_()
            elif is_norm:
                data.fill_(1.0)
            else:
                data.normal_(0.0, INIT_STD, generator=generator)
            module.register_parameter(name, torch.nn.Parameter(data, requires_grad=param.requires_grad))
    return model.to(device)  # the buffers


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
    # The small components (VAE, one-layer text encoders: < 0.3 B parameters) use their libraries'
    # own initialisation, on the host in fp32, then move.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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


def sanity_check(pipe, device: torch.device) -> dict:
    """One prompt through diffrl's adapter at 64x64 (one frame): encode, one velocity, decode. An
    edit family's prompt comes with its condition image(s) (`condition_image`, 64x64, resized by
    the adapter as by the pipeline: about one megapixel).

    Raises if the velocity or the pixels are not finite; returns their statistics.
    """
    from diffrl.models import adapter_class

    adapter = adapter_class(type(pipe).__name__)(pipe, torch.device(device), torch.bfloat16)
    size = 64
    prompts = ["a red circle left of a blue square"]
    rule = adapter.condition_rule
    with torch.no_grad():
        if rule is None:
            cond = adapter.encode_prompts(prompts, None, 16)
        else:
            images = [[condition_image(size, size, seed) for seed in range(rule.min_images)]]
            cond = adapter.encode_conditioned(prompts, None, 16, images)
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _report_progress(path: Path, expected: float, done: threading.Event, every_s: float) -> None:
    start = time.perf_counter()
    while not done.wait(every_s):
        written = _dir_bytes(path) / GB
        elapsed = time.perf_counter() - start
        print(f"  ... {written:.1f} / ~{expected:.1f} GB written ({elapsed:.0f} s)", flush=True)


def write(family: str, out: Path, device: str, layers: int | None = None, seed: int = 0) -> dict:
    """Build, check and save the pipeline at `out` (which must not exist); returns a summary."""
    from diffrl.models.qwen_image_edit import save_pipeline

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
        save_pipeline(pipe, staging)  # safetensors; an edit pipeline's processor by its real class
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
