"""The torch half of the `vlm_judge` reward (diffrl.rewards.vlm_judge): load the judge, score questions.

A separate module so that declaring and validating the reward (`diffrl config`) never imports torch
or transformers; the reward's constructor imports this one.

Loading. config.json's `model_type` picks the model and processor classes (`FAMILIES`). The
processor is built from the directory's parts, the tokenizer (`AutoTokenizer`), the image processor
(`AutoImageProcessor`: the torchvision backend where torchvision is installed, else the PIL one) and
the chat template (`chat_template.jinja`, else `chat_template.json`, else the tokenizer's), into
the family's own processor class without its video part: transformers 5 builds a video processor
for these processors, whose class needs torchvision, and a judge of images never uses it. Its
`__call__` is the family's, so the token ids and pixel values are the ones the real processor makes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from diffrl.rewards.base import auto_device, auto_dtype
from diffrl.rewards.vlm_judge import JudgeSettings

#: config.json `model_type` -> (model class, processor class), transformers' names.
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _missing(directory: Path, what: str, names: tuple[str, ...]) -> FileNotFoundError:
    return FileNotFoundError(
        f"vlm_judge reward: {directory} has no {what}: expected "
        + " or ".join(str(directory / n) for n in names)
        + "; the model directory must be a full snapshot of a Qwen2.5-VL / Qwen3-VL checkpoint "
        "(nothing is fetched at run time)"
    )


def check_judge_dir(model: str) -> tuple[Path, str]:
    """(the directory, its model_type), checked to hold every file loading needs."""
    if not isinstance(model, str) or not model:
        raise ValueError(
            "vlm_judge reward: args.model is empty; set reward.functions.vlm_judge.args.model to a local "
            "Qwen2.5-VL or Qwen3-VL directory"
        )
    directory = Path(model).expanduser()
    if not directory.is_dir():
        state = "is a file" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"vlm_judge reward: args.model={model!r} {state}; it must be a local directory holding a "
            "Qwen2.5-VL or Qwen3-VL checkpoint (e.g. `huggingface-cli download Qwen/Qwen2.5-VL-7B-Instruct "
            "--local-dir DIR` beforehand; nothing is fetched at run time)"
        )
    if not (directory / "config.json").is_file():
        raise _missing(directory, "model config", ("config.json",))
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"vlm_judge reward: {directory / 'config.json'} has model_type={model_type!r}; the judge runs "
            f"{', '.join(FAMILIES)} checkpoints (Qwen2.5-VL, Qwen3-VL). Other judges: serve them with "
            "`diffrl serve-reward` as a module:function reward (docs/rewards.md)"
        )
    if not any((directory / n).is_file() for n in WEIGHT_FILES):
        raise _missing(directory, "weights", WEIGHT_FILES)
    if not (
        (directory / "tokenizer.json").is_file()
        or all((directory / n).is_file() for n in ("vocab.json", "merges.txt"))
    ):
        raise _missing(directory, "tokenizer", ("tokenizer.json", "vocab.json + merges.txt"))
    if not (directory / "preprocessor_config.json").is_file():
        raise _missing(directory, "image processor config", ("preprocessor_config.json",))
    return directory, model_type


def chat_template(directory: Path, tokenizer: Any) -> str:
    """The checkpoint's chat template: chat_template.jinja, chat_template.json, or the tokenizer's."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "chat_template.json").is_file():
        return json.loads((directory / "chat_template.json").read_text())["chat_template"]
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        return tokenizer.chat_template
    raise _missing(directory, "chat template", ("chat_template.jinja", "chat_template.json"))


def image_only_processor(name: str) -> type:
    """The family's processor class, accepting `video_processor=None` (module docstring)."""
    base = getattr(transformers, name)

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        f"ImageOnly{name}", (base,), {"check_argument_for_proper_class": check_argument_for_proper_class}
    )


def single_token(tokenizer: Any, token: str, arg: str, directory: Path) -> int:
    """The id of `token`, which must encode to exactly one token of the judge's vocabulary."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(
            f"vlm_judge reward: reward.functions.vlm_judge.args.{arg}={token!r} is {len(ids)} tokens "
            f"({pieces}) in the tokenizer of {directory}; it must be one token, the first token of the "
            "answer: e.g. 'Yes' / 'No' for Qwen (the answer starts right after the chat template's "
            "assistant turn, without a leading space)"
        )
    return int(ids[0])


class VlmScorer:
    """A judge loaded once; `p_yes(queries)` scores (images, question) pairs."""

    def __init__(self, model: str, settings: JudgeSettings) -> None:
        directory, model_type = check_judge_dir(model)
        model_name, processor_name = FAMILIES[model_type]
        self.device = auto_device(settings.device)
        self.dtype = auto_dtype(settings.dtype, self.device)
        self.batch_size = settings.batch_size
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if tokenizer.pad_token_id is None:
            raise ValueError(
                f"vlm_judge reward: the tokenizer of {directory} has no pad token; batches are left-padded, "
                "so tokenizer_config.json must name one (Qwen's is <|endoftext|>)"
            )
        self.yes_id = single_token(tokenizer, settings.yes_token, "yes_token", directory)
        self.no_id = single_token(tokenizer, settings.no_token, "no_token", directory)
        if self.yes_id == self.no_id:
            raise ValueError(
                f"vlm_judge reward: yes_token={settings.yes_token!r} and no_token={settings.no_token!r} are "
                f"the same token ({self.yes_id}) in {directory}; choose two different answers"
            )
        image_processor = transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
        self.processor = image_only_processor(processor_name)(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=chat_template(directory, tokenizer),
        )
        self.size: dict[str, int] | None = None
        if settings.max_pixels is not None:
            smallest = int(image_processor.size["shortest_edge"])
            if settings.max_pixels < smallest:
                raise ValueError(
                    f"vlm_judge reward: reward.functions.vlm_judge.args.max_pixels={settings.max_pixels} is below "
                    f"the image processor's minimum of {smallest} pixels ({directory / 'preprocessor_config.json'}); "
                    f"use at least {smallest}"
                )
            self.size = {"shortest_edge": smallest, "longest_edge": settings.max_pixels}
        loaded = getattr(transformers, model_name).from_pretrained(
            directory, local_files_only=True, dtype=self.dtype
        )
        self.model = loaded.to(self.device).eval().requires_grad_(False)
        head = self.model.lm_head
        rows = [self.yes_id, self.no_id]
        # The two logits in float32 from the last hidden state: bf16 logits would round z_yes - z_no
        # to ~1/8 at typical magnitudes, a few percent of P(Yes).
        self.head_weight_2D = head.weight[rows].detach().to(torch.float32)
        self.head_bias_2 = None if head.bias is None else head.bias[rows].detach().to(torch.float32)

    def texts(self, queries: list[tuple[list[Image.Image], str]]) -> list[str]:
        """Each query as the chat template renders it: one user turn (its images, then the question),
        then the start of the assistant's turn."""
        return [
            self.processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": question}],
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for images, question in queries
        ]

    def inputs(self, queries: list[tuple[list[Image.Image], str]]) -> Any:
        """The processor's batch for `queries`, left-padded, on the judge's device."""
        images = [image for shown, _ in queries for image in shown]
        extra = {} if self.size is None else {"size": self.size}
        batch = self.processor(
            text=self.texts(queries),
            images=images,
            padding=True,
            padding_side="left",
            return_tensors="pt",
            **extra,
        ).to(self.device)
        batch["pixel_values"] = batch["pixel_values"].to(self.dtype)
        return batch

    @torch.inference_mode()
    def answer_logits(self, queries: list[tuple[list[Image.Image], str]]) -> torch.Tensor:
        """float32 (Q, 2): the logits of (yes_token, no_token) as the next token of each query."""
        out = []
        for start in range(0, len(queries), self.batch_size):
            batch = self.inputs(queries[start : start + self.batch_size])
            if not bool(batch["attention_mask"][:, -1].all()):
                raise RuntimeError("vlm_judge reward: the batch is not left-padded")  # a processor change
            hidden_BD = self.model.model(**batch).last_hidden_state[:, -1].to(torch.float32)
            logits_B2 = hidden_BD @ self.head_weight_2D.T
            if self.head_bias_2 is not None:
                logits_B2 = logits_B2 + self.head_bias_2
            out.append(logits_B2.cpu())
        return torch.cat(out)

    def p_yes(self, queries: list[tuple[list[Image.Image], str]]) -> torch.Tensor:
        """float32 (Q,): softmax over (z_yes, z_no), the first entry, per query."""
        return self.answer_logits(queries).softmax(dim=-1)[:, 0]
