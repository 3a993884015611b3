"""The text encoders of the 2026 families at full size, for `random_pipelines.py`: the published
configs (Qwen3-4B/8B, Qwen3-VL-8B, Mistral-Small-3.2-24B with its Pixtral tower), meta models for
parameter counts, and random bf16 weights made on the device (`materialise_`, the seeded init that
`random_pipelines.py` also gives its transformers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights

INIT_STD = 0.02
GB = 1e9


@dataclass(frozen=True)
class TextEncoder:
    """A family's text encoder at full size (random weights, the published config) or, under
    `--layers`, at its real width (which the transformer consumes) with only the hidden layers the
    pipeline reads and narrow attention and MLPs."""

    model_class: str  # in transformers
    config_class: str
    #: the text model's config (for the vision-language encoders, their `text_config`)
    text_config: dict
    #: a vision-language encoder's `vision_config` (full size; None for a text-only one)
    vision_config: dict | None
    #: `text_config` changes under `--layers` (the layers the pipeline reads, narrow heads and MLP)
    small_text: dict
    small_vision: dict | None
    #: the transformers class's total parameters at the published config (embeddings once)
    published_params: int
    source: str
    #: other top-level config keys (the composite configs)
    extra: dict = dataclasses.field(default_factory=dict)


# Qwen/Qwen3-4B config.json (tied embeddings: 4.02 B) and Qwen/Qwen3-8B (untied: 8.19 B).
QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# mistralai/Mistral-Small-3.2-24B-Instruct-2506 config.json (FLUX.2 [dev]'s text_encoder/): a
# Mistral text model of 40 layers x 5120 and a Pixtral vision tower of 24 layers x 1024.
MISTRAL_SMALL_3_TEXT = dict(
    model_type="mistral",
    vocab_size=131072,
    hidden_size=5120,
    intermediate_size=32768,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000000.0},
    tie_word_embeddings=False,
)
MISTRAL_SMALL_3_VISION = dict(
    model_type="pixtral",
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    head_dim=64,
    image_size=1540,
    patch_size=14,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Qwen/Qwen3-VL-8B-Instruct config.json (Qwen-Image 2.1's text_encoder/): 36 layers x 4096,
# interleaved M-RoPE, a 27-block vision tower of width 1152 with deepstack taps 8/16/24.
QWEN3_VL_8B_TEXT = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
)
QWEN3_VL_8B_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=4096,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
    hidden_act="gelu_pytorch_tanh",
)
#: narrow attention and MLP for `--layers` runs (the width stays)
_NARROW = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32)
# FLUX.2 reads hidden layers (9, 18, 27) of Qwen3 and (10, 20, 30) of Mistral; Z-Image the second
# to last; Qwen-Image 2.1 the last one.
_QWEN3_4B_KLEIN = TextEncoder(
    "Qwen3ForCausalLM",
    "Qwen3Config",
    QWEN3_4B,
    None,
    {**_NARROW, "num_hidden_layers": 28},
    None,
    4_022_468_096,
    "Qwen/Qwen3-4B (safetensors total, tied embeddings)",
)
TEXT_ENCODERS: dict[str, TextEncoder] = {
    "flux2_klein_4b": _QWEN3_4B_KLEIN,
    "flux2_klein_9b": TextEncoder(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        QWEN3_8B,
        None,
        {**_NARROW, "num_hidden_layers": 28},
        None,
        8_190_735_360,
        "Qwen/Qwen3-8B (safetensors total)",
    ),
    "flux2_dev": TextEncoder(
        "Mistral3ForConditionalGeneration",
        "Mistral3Config",
        MISTRAL_SMALL_3_TEXT,
        MISTRAL_SMALL_3_VISION,
        {**_NARROW, "num_hidden_layers": 31},
        dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8),
        24_011_361_280,
        "mistralai/Mistral-Small-3.2-24B-Instruct-2506 (safetensors total, '24B')",
        dict(
            spatial_merge_size=2,
            multimodal_projector_bias=False,
            projector_hidden_act="gelu",
            tie_word_embeddings=False,
        ),
    ),
    # ZImagePipeline's text encoder is the Qwen3 base model (no LM head): Qwen3-4B's count, tied.
    "zimage_turbo": dataclasses.replace(
        _QWEN3_4B_KLEIN,
        model_class="Qwen3Model",
        small_text={**_NARROW, "num_hidden_layers": 2},
        source="Qwen/Qwen3-4B, as Tongyi-MAI/Z-Image-Turbo text_encoder/ (Qwen3Model)",
    ),
    "qwen_image21": TextEncoder(
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLConfig",
        QWEN3_VL_8B_TEXT,
        QWEN3_VL_8B_VISION,
        # head_dim 16: the M-RoPE sections sum to half of it
        {
            **_NARROW,
            "num_hidden_layers": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            deepstack_visual_indexes=[],
            num_position_embeddings=64,
        ),
        8_767_123_696,
        "Qwen/Qwen3-VL-8B-Instruct (safetensors total; Qwen-Image 2.1's text_encoder/, vision tower "
        "and LM head included)",
        dict(tie_word_embeddings=False),
    ),
}


def text_encoder_config(
    family: str, layers: int | None = None, text: dict | None = None, top: dict | None = None
):
    """The family's text encoder config (transformers): the published one, or under `layers` the
    narrow one of `TextEncoder.small_text`. `text` adds keys to the text model's config (the
    tokenizer's vocabulary size and special-token ids), `top` to a composite config's top level."""
    import transformers

    spec = TEXT_ENCODERS[family]
    text_config = {**spec.text_config, **(spec.small_text if layers is not None else {}), **(text or {})}
    config_class = getattr(transformers, spec.config_class)
    if spec.vision_config is None:
        return config_class(**text_config, **(top or {}))
    vision = {**spec.vision_config, **(spec.small_vision if layers is not None else {})}
    if "out_hidden_size" in spec.vision_config:  # Qwen3-VL's merger projects to the text width
        vision["out_hidden_size"] = text_config["hidden_size"]
    return config_class(text_config=text_config, vision_config=vision, **spec.extra, **(top or {}))


def empty_text_encoder(family: str, layers: int | None = None, text=None, top=None) -> torch.nn.Module:
    """The text encoder with meta parameters, its embeddings tied where the config ties them."""
    import transformers

    cls = getattr(transformers, TEXT_ENCODERS[family].model_class)
    with init_empty_weights():
        model = cls(text_encoder_config(family, layers, text, top))
    model.tie_weights()
    return model


def random_text_encoder(family: str, device, layers: int | None, seed: int, text=None, top=None):
    """`empty_text_encoder` given bf16 storage on `device` (`materialise_`: the host never holds
    the 4-24 B parameters in fp32), embeddings re-tied, in eval mode."""
    model = materialise_(
        empty_text_encoder(family, layers, text, top), torch.device(device), torch.bfloat16, seed
    )
    model.tie_weights()
    return model.eval()


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


def text_encoder_plan(family: str, layers: int | None) -> dict:
    """The text encoder's class and count (families whose text encoder is built at full size)."""
    if family not in TEXT_ENCODERS:
        return {}
    spec = TEXT_ENCODERS[family]
    params = sum(p.numel() for p in empty_text_encoder(family, layers).parameters())
    return {
        "text_encoder": spec.model_class,
        "text_encoder_params": params,
        "text_encoder_published_params": spec.published_params if layers is None else None,
        "text_encoder_source": spec.source,
        "text_encoder_bf16_weight_gb": 2 * params / GB,
    }
