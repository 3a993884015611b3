"""Write an SD3.5-Medium-sized pipeline with random weights to a directory (for GPU runs of `diffrl train`).

The transformer and VAE have the real SD3.5-Medium architecture; the three text encoders keep the
real output widths (CLIP-L 768, CLIP-G 1280, T5 4096: what the transformer consumes) but have one
layer each, and the tokenizers are diffrl's tiny offline ones: prompt encoding runs once per prompt,
so its cost is not what a training step measures.

    python benchmarks/random_sd35_medium.py /tmp/sd35m
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

sys.path.insert(0, str(Path(__file__).parent))
from rollout import SD3_VAE, transformer_config

from diffrl.models.tiny_text import clip_tokenizer, t5_tokenizer, text_encoder_ids


def clip(tokenizer, hidden: int) -> CLIPTextModelWithProjection:
    ids = text_encoder_ids(tokenizer)
    config = CLIPTextConfig(
        hidden_size=hidden,
        projection_dim=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=hidden // 64,
        max_position_embeddings=77,
        **ids,
    )
    return CLIPTextModelWithProjection(config)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=24, help="fewer transformer layers for a CPU smoke run")
    args = parser.parse_args()
    config = transformer_config(args.layers)
    torch.manual_seed(0)
    tok_clip, tok_t5 = clip_tokenizer(), t5_tokenizer()
    t5_ids = text_encoder_ids(tok_t5)
    t5 = T5EncoderModel(
        T5Config(
            d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=2, decoder_start_token_id=0, **t5_ids
        )
    )
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**config),
        vae=AutoencoderKL(**SD3_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=clip(tok_clip, 768),
        tokenizer=tok_clip,
        text_encoder_2=clip(tok_clip, 1280),
        tokenizer_2=tok_clip,
        text_encoder_3=t5,
        tokenizer_3=tok_t5,
    ).to(torch.bfloat16)
    pipe.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
