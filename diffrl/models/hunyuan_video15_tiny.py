"""The tiny random HunyuanVideo-1.5 text-to-video pipeline (`tiny:hunyuan_video15`), built offline.

Real diffusers/transformers classes at small sizes, saved with `save_pretrained`, so the tests load
it through the same `from_pretrained` path as the real checkpoint (`diffrl.models.tiny`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from diffrl.models.hunyuan_video15 import TEMPLATE_PREFIX_TOKENS

#: HunyuanVideo-1.5 480p text-to-video's scheduler (FlowMatchEulerDiscreteScheduler, static shift 5).
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 5.0, "use_dynamic_shifting": False}

#: Qwen2.5-VL's chat template, reduced to what the pipeline asks of it (a system and a user
#: message with string contents, the generation prompt): the same text for those calls.
QWEN25_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _system_message() -> str:
    """The pipeline's system message (the default of its MLLM encoding helper, the same text its
    `__init__` sets), from diffusers itself."""
    from diffusers import HunyuanVideo15Pipeline

    signature = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return signature.parameters["system_message"].default


def tiny_tokenizer():
    """A byte-level BPE `Qwen2Tokenizer` built offline (`qwen_image_tiny.tiny_qwen2_tokenizer`)
    trained on the pipeline's chat text, so that the system part is exactly the 108 tokens the
    pipeline crops (as the real Qwen2.5-VL tokenizer splits it), with `QWEN25_VL_CHAT_TEMPLATE`."""
    from diffrl.models.qwen_image_tiny import tiny_qwen2_tokenizer

    system = _system_message().replace("{", "{{").replace("}", "}}")
    template = (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
    )
    tokenizer = tiny_qwen2_tokenizer(template, TEMPLATE_PREFIX_TOKENS, vocab_size=640)
    tokenizer.chat_template = QWEN25_VL_CHAT_TEMPLATE
    return tokenizer


def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random HunyuanVideo-1.5-shaped text-to-video pipeline to `path` (real classes).

    `HunyuanVideo15Transformer3DModel` with 2 heads x 16 (RoPE axes 4/6/6), 2 blocks and 1 text
    refiner block, 4 latent channels (in 9 = 2·4 + 1), patch 1, MLLM width 32, ByT5 width 16, image
    width 8 (its ByT5 projection keeps diffusers' fixed 2048 hidden width: most of the ~17 MB);
    an `AutoencoderKLHunyuanVideo15` with the real compression (x4 time, x16 space); a 3-layer
    `Qwen2_5_VLTextModel` (hidden 32) with the offline tokenizer of `tiny_tokenizer`; a 2-layer
    `T5EncoderModel` (d_model 16) with `ByT5Tokenizer` (bytes: no vocabulary file); the 480p
    scheduler config (shift 5); a `ClassifierFreeGuidance(guidance_scale=6.0)` guider (the model
    card's). Deterministic from `seed`.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    text_dim, byt5_dim, z_dim = 32, 16, 4
    tokenizer = tiny_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * z_dim + 1,
            out_channels=z_dim,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=text_dim,
            text_embed_2_dim=byt5_dim,
            image_embed_dim=8,
            rope_axes_dim=(4, 6, 6),
            target_size=64,
            task_type="t2v",
        )
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=ids("<|endoftext|>"),
                eos_token_id=ids("<|im_end|>"),
                pad_token_id=ids("<|endoftext|>"),
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=byt5_dim,
                d_kv=8,
                d_ff=32,
                num_layers=2,
                num_heads=2,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=32,
                feed_forward_proj="gated-gelu",
                dropout_rate=0.0,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
                decoder_start_token_id=tokenizer_2.pad_token_id,
            )
        )
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=z_dim,
            block_out_channels=(8, 8, 16, 16, 16),
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
            scaling_factor=1.03682,
        )
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.save_pretrained(path)
    return Path(path)


__all__ = ["build_tiny", "tiny_tokenizer"]
