"""The shapes edit task's model: a pixel-space FLUX.1 Kontext small enough to train on a CPU.

A real `FluxKontextPipeline` directory, so it runs through the code the real edit family uses (the
FLUX.1 Kontext adapter, condition images from prompt rows, the sampler, the trainer, LoRA, export):

- `FluxTransformer2DModel` on pixels: a 32x32 RGB image packed 2x2 (the FLUX layout) is 16x16 = 256
  tokens of 12 values; the condition image (the source to edit) is 256 more tokens, appended with
  position ids whose first coordinate is 1, as Kontext appends its VAE latents, so attention can
  find the source pixel at the same (row, column). Width 128 (4 heads of 32, RoPE axes 8 + 12 + 12),
  `double_layers` double-stream and `single_layers` single-stream blocks, no guidance embedding
  (the model is not guidance-distilled). Pixel space needs no VAE (model_index.json lists `vae` as
  null; see `diffrl.models.flux` and `diffrl.models.flux_kontext`).
- Text: FLUX's CLIP (pooled vector) and T5 (token embeddings), tiny and frozen at their seeded
  random initialisation, with the tiny tokenizers of `diffrl.models.tiny_text` whose vocabulary
  adds the edit verbs (`EDIT_WORDS`) to the shapes words, so every instruction word is one token.
- Scheduler: flow-match Euler with shift 1, no dynamic shift (a 32x32 image has few pixels).

`build_toy_edit(path, seed)` writes the random initialisation (`tiny:toy_edit`); `diffrl sft
shapes_edit_sft` trains it on the shapes edit task's renderings (docs/shapes.md, "The edit task").
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffrl.models.tiny_text import WORDS

#: Image side the edit model is trained for.
RESOLUTION = 32
#: The instruction verbs, added to the tokenizers' whole words.
EDIT_WORDS: tuple[str, ...] = ("make", "turn", "into", "add", "remove", "move")
#: T5 tokens per instruction (`rollout.pipeline.max_sequence_length`): the longest instruction
#: ("move the triangle right of the square") is 7 words plus the end token.
TEXT_TOKENS = 12
_CLIP_TOKENS = 16


def build_toy_edit(
    path: str | Path, seed: int = 0, *, width: int = 128, double_layers: int = 2, single_layers: int = 4
) -> Path:
    """Write the randomly initialised edit pipeline (deterministic in `seed`) to `path`.

    `width` (a multiple of 32: heads of 32) and the block counts size the transformer."""
    if (
        width <= 0
        or width % 32
        or double_layers < 0
        or single_layers < 0
        or double_layers + single_layers == 0
    ):
        raise ValueError(
            "build_toy_edit needs a positive width that is a multiple of 32 and at least one block, got "
            f"width={width}, double_layers={double_layers}, single_layers={single_layers}"
        )
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffrl.models.tiny_text import clip_tokenizer, t5_tokenizer, text_encoder_ids

    path = Path(path)
    words = (*WORDS, *EDIT_WORDS)
    text_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_tok = clip_tokenizer(words, model_max_length=_CLIP_TOKENS)
        t5_tok = t5_tokenizer(words)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=text_dim,
                intermediate_size=4 * text_dim,
                projection_dim=text_dim,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=_CLIP_TOKENS,
                **text_encoder_ids(clip_tok),
            )
        ).eval()
        text_encoder_2 = T5EncoderModel(
            T5Config(
                d_model=text_dim,
                d_kv=16,
                d_ff=4 * text_dim,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                decoder_start_token_id=t5_tok.pad_token_id,
                **text_encoder_ids(t5_tok),
            )
        ).eval()
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=12,  # RGB packed 2x2
            num_layers=double_layers,
            num_single_layers=single_layers,
            attention_head_dim=32,
            num_attention_heads=width // 32,
            joint_attention_dim=text_dim,
            pooled_projection_dim=text_dim,
            guidance_embeds=False,
            axes_dims_rope=(8, 12, 12),
        )
        pipe = FluxKontextPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
            vae=None,
            text_encoder=text_encoder,
            tokenizer=clip_tok,
            text_encoder_2=text_encoder_2,
            tokenizer_2=t5_tok,
            transformer=transformer,
        )
        pipe.save_pretrained(path)
    return path


__all__ = ["EDIT_WORDS", "RESOLUTION", "TEXT_TOKENS", "build_toy_edit"]
