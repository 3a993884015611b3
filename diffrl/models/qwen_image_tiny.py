"""Tiny random Qwen-Image pipelines, built offline: `build_tiny` and what the edit families reuse.

`build_tiny` writes the `tiny:qwen_image` directory (`diffrl.models.tiny`); `tiny_pipeline`
builds the same components for any pipeline class of the family (the edit pipelines add a
processor); `tiny_qwen2_tokenizer` trains a small Qwen2 tokenizer on a pipeline's own prompt
template (Z-Image reuses it with its own template). Apart from `diffrl.models.qwen_image` (the
adapter: how diffrl drives the pipeline) because building test models needs the tokenizers and
transformers libraries and none of the adapter's code, and the adapter none of this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

#: The real checkpoint's scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json).
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# Special tokens of the Qwen2 / Qwen2.5-VL vocabulary the tiny tokenizer carries (the chat template
# uses <|im_start|> and <|im_end|>; <|endoftext|> pads; the vision tokens keep the encoder config's ids
# inside the vocabulary).
_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_TINY_VOCAB_SIZE = 512
# Words the tiny vocabulary learns whole (beyond the prompt template's): the kind of prompts the
# tests and the shapes world use.
_TINY_CORPUS_WORDS = (
    "a photo of an image with one two three four five red green blue yellow purple orange black white "
    "circle square triangle star cat dog on the left right top bottom above below next to small large "
    "blurry low quality text that says hello world"
)


def tiny_qwen2_tokenizer(
    prompt_template: str, template_start_idx: int | None, vocab_size: int = _TINY_VOCAB_SIZE
):
    """A byte-level BPE `Qwen2Tokenizer` built offline with the `tokenizers` library.

    Trained on the pipeline's prompt template (so that the template's prefix, up to the prompt or,
    in the edit templates, up to the image, is `template_start_idx` tokens, 34 (64 for the edit
    templates) like the real tokenizer's, and the pipeline's `prompt_template_encode_start_idx`
    drops exactly the template's system part) plus a few common words, to `vocab_size` tokens. The
    pre-tokenizer (Qwen2's regex split + byte level), normaliser (NFC) and decoder are the ones
    `Qwen2Tokenizer` sets itself; <|im_start|> / <|im_end|> and the other Qwen2.5-VL special
    tokens are special tokens, <|endoftext|> pads. `template_start_idx=None` skips the prefix check
    (a pipeline that measures its prefix from the tokenizer itself, as `QwenImage21Pipeline` does).
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(
        [prompt_template.format(_TINY_CORPUS_WORDS)] * 8 + [_TINY_CORPUS_WORDS] * 8, trainer
    )
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(pair) for pair in model["merges"]],
        additional_special_tokens=list(_SPECIAL_TOKENS[1:]),
    )
    if template_start_idx is None:
        return tokenizer
    prefix = prompt_template.split("{}")[0].split("<|vision_start|>")[0]
    prefix_len = len(tokenizer(prefix).input_ids)
    if prefix_len != template_start_idx:
        raise AssertionError(
            f"the tiny tokenizer splits the prompt template's prefix into {prefix_len} tokens; "
            f"the pipeline drops {template_start_idx}"
        )
    return tokenizer


def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image pipeline (real diffusers/transformers classes) to `path`.

    Transformer: 2 dual-stream blocks, 2 heads x 16, text dim 32, in_channels 64 (16 x 2 x 2) as the
    real one. VAE: `AutoencoderKLQwenImage` with 3 downsamples (8x, as real) and z_dim 16 with the
    real latents_mean/std (the class defaults). Text encoder: `Qwen2_5_VLForConditionalGeneration`
    with a 2-layer text model (hidden 32, mrope) and a 1-block vision tower. Tokenizer:
    `tiny_qwen2_tokenizer` on the pipeline's own template. Scheduler: the real config.
    Deterministic from `seed`; about 1 MB.
    """
    pipe = tiny_pipeline(QwenImagePipeline, seed)
    pipe.save_pretrained(path)
    return Path(path)


def tiny_pipeline(
    pipeline_class: type,
    seed: int,
    vocab_size: int = _TINY_VOCAB_SIZE,
    vae_base_dim: int = 8,
    **components: Any,
):
    """A tiny random pipeline of `pipeline_class` (Qwen-Image or one of its edit pipelines), its
    tokenizer and text encoder built for the class's own prompt template (`build_tiny`);
    `vae_base_dim` the VAE's first width (the edit pipelines encode ~1 MP condition images, which a
    narrower VAE does faster on a CPU); `components` further pipeline components (the edit
    pipelines' processor, given as a function of the tokenizer)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_dim = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=text_dim,
            axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=vae_base_dim,
            z_dim=16,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        # The prompt template and its prefix length live on pipeline instances (set in __init__):
        # build the pipeline first, then the tokenizer and text encoder that must agree with them.
        pipe = pipeline_class(
            scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            transformer=transformer,
            **dict.fromkeys(components),
        )
        tokenizer = tiny_qwen2_tokenizer(
            pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, vocab_size
        )
        ids = tokenizer.convert_tokens_to_ids
        encoder_config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": text_dim,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 2048,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [2, 3, 3],
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
                "out_hidden_size": text_dim,
                "fullatt_block_indexes": [0],
            },
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(encoder_config).eval()
    pipe.register_modules(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        **{name: make(tokenizer) for name, make in components.items()},
    )
    return pipe
