"""Tiny random Qwen2.5-VL and Qwen3-VL judges saved as real model directories, built offline.

For tests and smoke runs of the `vlm_judge` reward without downloads: the reward loads these
through exactly the code path that loads Qwen/Qwen2.5-VL-7B-Instruct or Qwen/Qwen3-VL-8B-Instruct
(config.json's `model_type` picks the class; tokenizer, image processor and chat template come
from the directory). The answers mean nothing; they are deterministic for a given seed.

What `save_tiny_vlm(path, family)` writes, the layout of a hub snapshot of those repositories:

    config.json, generation_config.json, model.safetensors   the random model (1 text layer, 1 vision block)
    tokenizer.json, tokenizer_config.json                    a byte-level BPE `Qwen2Tokenizer` (below)
    preprocessor_config.json                                 `Qwen2VLImageProcessor`, small pixel bounds
    chat_template.json                                       the family's chat template (below)

The tokenizer is trained here with the `tokenizers` library on the judge's default questions and a
few prompt words (to ~400 tokens), with Qwen2's pre-tokenizer (its regex split + byte level) and
Qwen2.5-VL's special tokens (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`,
...; `<|endoftext|>` pads), so "Yes" and "No" are single tokens as in the real vocabulary.

The chat templates are the real ones cut down to what a judge sends (one user turn of images and
text, then the assistant's turn): Qwen2.5-VL's adds its default system turn ("You are a helpful
assistant."), Qwen3-VL's has none. They render such a conversation to the same text as the
templates shipped with the real checkpoints.

Image sizes: patches of 14 px (Qwen2.5-VL) or 16 px (Qwen3-VL), merged 2 x 2, so one image token
covers 28² or 32² px; the processors here resize every image to between 1 and 4 tokens' worth of
pixels (28²..56², 32²..64²), which keeps a forward pass to a few milliseconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The families a tiny judge can be built for (config.json's `model_type`).
FAMILIES = ("qwen2_5_vl", "qwen3_vl")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    "Yes No yes no Does this image show a photo of an the first image is the original and second result "
    "of editing it with instruction follow Please answer or Is there red green blue yellow circle square "
    "triangle star cat dog on left right top bottom above below next to small large make two three"
)


def tiny_qwen2_tokenizer(vocab_size: int = 400):
    """A byte-level BPE `Qwen2Tokenizer` with Qwen2.5-VL's special tokens, trained offline."""
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
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_CORPUS] * 8, trainer)
    model = json.loads(bpe.to_str())["model"]
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(pair) for pair in model["merges"]],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def save_tiny_vlm(
    path: str | Path, family: str = "qwen2_5_vl", *, seed: int = 0, hidden_size: int = 32
) -> Path:
    """Write a tiny random Qwen2.5-VL (`family="qwen2_5_vl"`) or Qwen3-VL (`"qwen3_vl"`) judge
    directory to `path` (module docstring); about 0.3 MB."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    qwen3 = family == "qwen3_vl"
    patch = 16 if qwen3 else 14
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=(2 * patch) ** 2, max_pixels=(4 * patch) ** 2, patch_size=patch, merge_size=2
    )
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6 if qwen3 else 1e6,
            "mrope_section": [2, 3, 3],
            **({"mrope_interleaved": True} if qwen3 else {}),
        },
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
        # wider weights than the default 0.02, so that the random judge's answers differ visibly
        "initializer_range": 0.2,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": hidden_size,
        "patch_size": patch,
    }
    if qwen3:
        text_config["head_dim"] = hidden_size // 2
        vision_config.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    else:
        vision_config["fullatt_block_indexes"] = [0]
        config_class = transformers.Qwen2_5_VLConfig
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_processor.save_pretrained(directory)
    processor_class = "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor"
    preprocessor = json.loads((directory / "preprocessor_config.json").read_text())
    preprocessor.update(image_processor_type="Qwen2VLImageProcessor", processor_class=processor_class)
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    template = QWEN3_VL_CHAT_TEMPLATE if qwen3 else QWEN2_5_VL_CHAT_TEMPLATE
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
    return directory


__all__ = [
    "FAMILIES",
    "QWEN2_5_VL_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "save_tiny_vlm",
    "tiny_qwen2_tokenizer",
]
