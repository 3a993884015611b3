"""The shapes world's text-to-image model: a pixel-space SD3 small enough to train RL on a CPU.

It is a real `StableDiffusion3Pipeline` directory, so it runs through exactly the code the real
families use (the SD3 adapter, the sampler, the trainer, LoRA, checkpoints, export):

- `SD3Transformer2DModel` on pixels: 3 input/output channels, patch 2 (a 32x32 image is 16x16 =
  256 tokens), 6 `JointTransformerBlock`s of width 128 (4 heads of 32), RMS qk-norm: ~3.5 M
  parameters. (A first attempt at 64x64 with patch 4, 48 pixel values per token, learned
  blotchy, speckled images: 2% held-out accuracy after 2500 SFT steps; this one reached 43% at
  step 3000.) Pixel space needs no VAE (model_index.json lists `vae` as null); see the SD3 adapter.
- Text: SD3's two CLIP encoders (`CLIPTextModelWithProjection`, 2 layers, width 64, frozen at
  their seeded random init) with the tiny tokenizers of `diffrl.models.tiny_text`, whose
  vocabulary holds every word of the shapes grammar as one token; 16 tokens per prompt. No T5:
  the pipeline then feeds zeros for T5's tokens, so `max_sequence_length` 1 keeps that to one token.
- Scheduler: flow-match Euler with shift 1 (a 32x32 image has few pixels; no resolution shift).

`build_toy(path, seed)` writes the random initialisation; `diffrl sft` with the `shapes_sft`
preset trains it on the renderer's images (docs/shapes.md has the exact command and seed), and the
trained directory ships in the package as the `toy:shapes` model.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: Image side the toy model is trained for (it also samples other multiples of the patch size).
RESOLUTION = 32
#: CLIP tokens per prompt: the longest shapes prompt has 8 words plus begin/end tokens.
TEXT_TOKENS = 16
#: What `rollout.pipeline.max_sequence_length` should be for the toy model: T5 is absent, and the
#: pipeline pads with this many zero tokens in its place.
T5_TOKENS = 1


def build_toy(path: str | Path, seed: int = 0, *, width: int = 128, layers: int = 6) -> Path:
    """Write the randomly initialised toy pipeline (deterministic in `seed`) to `path`.

    `width` (a multiple of 32: heads of 32) and `layers` size the transformer; the defaults are
    `toy:shapes`'s. The text encoders are the same at every size."""
    if width <= 0 or width % 32 or layers <= 0:
        raise ValueError(
            f"build_toy needs a positive width that is a multiple of 32 and layers > 0, got width={width}, layers={layers}"
        )
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from diffrl.models.tiny_text import clip_tokenizer, text_encoder_ids

    path = Path(path)
    clip_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = clip_tokenizer(model_max_length=TEXT_TOKENS)
        tokenizer_2 = clip_tokenizer(model_max_length=TEXT_TOKENS, pad_token="!")

        def clip(tok) -> CLIPTextModelWithProjection:
            config = CLIPTextConfig(
                hidden_size=clip_dim,
                intermediate_size=4 * clip_dim,
                projection_dim=clip_dim,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=TEXT_TOKENS,
                **text_encoder_ids(tok),
            )
            return CLIPTextModelWithProjection(config).eval()

        text_encoder, text_encoder_2 = clip(tokenizer), clip(tokenizer_2)
        transformer = SD3Transformer2DModel(
            sample_size=RESOLUTION,
            patch_size=2,
            in_channels=3,
            out_channels=3,
            num_layers=layers,
            attention_head_dim=32,
            num_attention_heads=width // 32,
            joint_attention_dim=2 * clip_dim,  # the two CLIPs' hidden states side by side
            caption_projection_dim=width,
            pooled_projection_dim=2 * clip_dim,  # the two CLIP projections side by side
            pos_embed_max_size=RESOLUTION // 2,
            qk_norm="rms_norm",
        )
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
            vae=None,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=None,
            tokenizer_3=None,
        )
        pipe.save_pretrained(path)
    return path


build_tiny = build_toy  # the `tiny:toy` model path builds the untrained initialisation

__all__ = ["RESOLUTION", "T5_TOKENS", "TEXT_TOKENS", "build_toy"]
