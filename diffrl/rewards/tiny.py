"""Tiny random CLIP models (with a real tokenizer and processor) saved as real directories.

For tests and smoke runs without downloads: the CLIP-family rewards load these through exactly the
code path that loads openai/clip-vit-large-patch14 or PickScore_v1. The scores mean nothing; they
are deterministic for a given seed.

The tokenizer is a byte-level BPE with no merges (every byte is its own token), which is a valid
CLIP tokenizer (`vocab.json` + `merges.txt`) of 514 tokens, built here, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffrl.rewards.clip import AESTHETIC_HEAD_FILE
from diffrl.rewards.clip_models import AestheticHead


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def save_tiny_clip(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    hidden_size: int = 32,
    projection_dim: int = 16,
    max_length: int = 32,
) -> Path:
    """Write a random CLIPModel + CLIPProcessor (tokenizer and image processor) to `path`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate([*symbols, *(s + "</w>" for s in symbols)])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        vocab_file=str(directory / "vocab.json"),
        merges_file=str(directory / "merges.txt"),
        model_max_length=max_length,
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
    layers = {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    config = CLIPConfig(
        text_config={
            **layers,
            "vocab_size": len(vocab),
            "max_position_embeddings": max_length,
            "bos_token_id": vocab["<|startoftext|>"],
            "eos_token_id": vocab["<|endoftext|>"],
            "pad_token_id": vocab["<|endoftext|>"],
        },
        vision_config={**layers, "image_size": image_size, "patch_size": image_size // 4},
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    model.save_pretrained(directory)
    return directory


def save_tiny_aesthetic_head(path: str | Path, *, embed_dim: int = 16, seed: int = 0) -> Path:
    """Write a random LAION-layout aesthetic MLP taking `embed_dim`-d embeddings; returns the file.

    `path` is a directory (the file goes in as aesthetic_head.safetensors) or a .safetensors file.
    """
    from safetensors.torch import save_file

    target = Path(path)
    if target.suffix != ".safetensors":
        target = target / AESTHETIC_HEAD_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = AestheticHead([embed_dim, 32, 16, 8, 4])
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(target))
    return target
