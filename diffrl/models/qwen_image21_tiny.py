"""A tiny random Qwen-Image 2.1 pipeline, built offline: `build_tiny` (`tiny:qwen_image21`).

Apart from `diffrl.models.qwen_image21` (the adapter) for the same reason as `qwen_image_tiny`:
building test models needs the tokenizers library and none of the adapter's code.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: A flow-matching scheduler config with the constants `QwenImage21Pipeline` falls back to for
#: its `calculate_shift` (base/max image tokens 256/4096, base/max shift 0.5/1.15) and dynamic
#: exponential shifting. The real checkpoint's scheduler_config.json was not available offline;
#: the adapter reads whatever config a checkpoint ships, so only the tiny model's schedule rests
#: on this one.
QWEN_IMAGE21_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}

#: The chat template reduced to what the pipeline asks of it: messages whose content is a string
#: or a list of {"type": "text"} parts (the pipeline's system message), and the generation prompt.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_T2I_TEMPLATE = (
    "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image 2.1 pipeline (real diffusers/transformers classes) to `path`.

    Transformer: `QwenImage21Transformer2DModel` with 2 single-stream blocks, 2 heads x 16 (RoPE
    axes 4/6/6), text width 32, 64 latent channels unpatched and `causal_condition` on, as the
    real one. VAE: `AutoencoderKLQwenImage21` with 4 downsamples (16x, as real), z_dim 64 and the
    class's (real) latents_mean/std, 4 channels in and out (RGBA) as the class default. Text
    encoder: `Qwen3VLForConditionalGeneration` with a 2-layer text model (hidden 32, interleaved
    mrope) and a 1-block vision tower. Processor: the saved files of a `Qwen3VLProcessor` (a
    byte-level BPE tokenizer trained offline on the pipeline's template, Qwen3-VL's special tokens,
    the chat template above, default image and video processor configs). Scheduler:
    `QWEN_IMAGE21_SCHEDULER_CONFIG`. 32x32 images give 4 latent tokens. Deterministic from `seed`.
    """
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from diffrl.models.qwen_image21 import Qwen3VLTextProcessor
    from diffrl.models.qwen_image_tiny import tiny_qwen2_tokenizer

    text_dim = 32
    tokenizer = tiny_qwen2_tokenizer(_T2I_TEMPLATE, None)
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImage21Transformer2DModel(
            patch_size=1,
            in_channels=64,
            out_channels=64,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=text_dim,
            mlp_ratio=3,
            axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage21(
            base_dim=8,
            decoder_base_dim=8,
            z_dim=64,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True, True],
        )
        encoder_config = Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": text_dim,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "max_position_embeddings": 2048,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5000000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
                "pad_token_id": ids("<|endoftext|>"),
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": text_dim,
                "deepstack_visual_indexes": [],
                "num_position_embeddings": 64,
            },
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
        text_encoder = Qwen3VLForConditionalGeneration(encoder_config).eval()
    processor = Qwen3VLTextProcessor(tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE21_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer.eval(),
    )
    # save with transformers' own processor class (its files load as a `Qwen3VLProcessor`)
    pipe.register_modules(processor=_full_processor(processor))
    pipe.save_pretrained(path)
    return Path(path)


def _full_processor(processor):
    """A `Qwen3VLProcessor` holding the text processor's tokenizer and chat template and default
    image and video processors, to save: its files are what the real class writes, so the
    directory loads with transformers' `Qwen3VLProcessor` where torchvision is installed. Only the
    video processor class needs torchvision to be checked inside a processor, not to write its
    config, so the processor is assembled without its constructor's checks."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    full = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    full.image_processor = Qwen2VLImageProcessorPil(patch_size=16)
    full.video_processor = Qwen3VLVideoProcessor()
    full.tokenizer = processor.tokenizer
    full.chat_template = processor.chat_template
    return full
