"""The torch half of the CLIP rewards (diffrl.rewards.clip): the CLIP encoder and the aesthetic head.

A separate module because `nn.Module` subclasses and `@torch.inference_mode()` methods need torch
when the class is defined; the rewards' constructors import this module, so declaring and
validating them (`diffrl config`) never does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffrl.files import check_regular
from diffrl.rewards.base import auto_device, auto_dtype
from diffrl.rewards.clip import check_clip_dirs


def _features(output: Any) -> torch.Tensor:
    """`get_image_features`/`get_text_features` return a tensor (transformers 4) or an output whose
    `pooler_output` holds the projected embedding (transformers 5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipEncoder:
    """A CLIP model and its processor, loaded once; L2-normalised image and text embeddings."""

    def __init__(
        self,
        reward: str,
        model: str,
        processor: str | None,
        *,
        text: bool,
        device: str,
        dtype: str,
        batch_size: int,
    ) -> None:
        from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

        model_dir, processor_dir = check_clip_dirs(reward, model, processor, text=text)
        if batch_size < 1:
            raise ValueError(f"{reward} reward: batch_size={batch_size!r} is invalid: must be >= 1")
        self.device = auto_device(device)
        self.dtype = auto_dtype(dtype, self.device)
        self.batch_size = batch_size
        self.model = CLIPModel.from_pretrained(model_dir, local_files_only=True)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        loader = CLIPProcessor if text else CLIPImageProcessor
        self.processor: Any = loader.from_pretrained(processor_dir, local_files_only=True)
        self.image_processor: Any = self.processor.image_processor if text else self.processor

    def _batched(self, items: list[Any], encode: Callable[[list[Any]], torch.Tensor]) -> torch.Tensor:
        chunks = [encode(items[i : i + self.batch_size]) for i in range(0, len(items), self.batch_size)]
        embeds = torch.cat(chunks).float()
        return embeds / embeds.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def image_embeds(self, frames_N3HW: torch.Tensor) -> torch.Tensor:
        """(N, D) float32 unit-norm image embeddings of uint8 RGB frames."""
        # HWC uint8 arrays: the processor resizes, crops, rescales and normalises exactly as in training.
        arrays = list(frames_N3HW.detach().cpu().permute(0, 2, 3, 1).contiguous().numpy())

        def encode(chunk: list[Any]) -> torch.Tensor:
            pixel_values = self.image_processor(images=chunk, return_tensors="pt")["pixel_values"]
            pixel_values = pixel_values.to(self.device, self.dtype)
            return _features(self.model.get_image_features(pixel_values=pixel_values))

        return self._batched(arrays, encode)

    @torch.inference_mode()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """(N, D) float32 unit-norm text embeddings; prompts past the context length are truncated."""
        tokenizer = self.processor.tokenizer

        def encode(chunk: list[str]) -> torch.Tensor:
            tokens = tokenizer(chunk, padding=True, truncation=True, return_tensors="pt").to(self.device)
            return _features(
                self.model.get_text_features(
                    input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
                )
            )

        return self._batched(prompts, encode)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())


class AestheticHead(nn.Module):
    """LAION improved-aesthetic-predictor MLP; layer indices match the released state dict."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        d0, d1, d2, d3, d4 = dims
        self.layers = nn.Sequential(
            nn.Linear(d0, d1),
            nn.Dropout(0.2),
            nn.Linear(d1, d2),
            nn.Dropout(0.2),
            nn.Linear(d2, d3),
            nn.Dropout(0.1),
            nn.Linear(d3, d4),
            nn.Linear(d4, 1),
        )

    def forward(self, embeds_ND: torch.Tensor) -> torch.Tensor:
        """(N, D) L2-normalised image embeddings -> (N, 1) predicted rating."""
        return self.layers(embeds_ND)

    KEYS = tuple(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))

    @classmethod
    def load(cls, path: Path) -> AestheticHead:
        """Build the head with the sizes found in the file and load it strictly."""
        from safetensors.torch import load_file

        state = load_file(str(check_regular(path, "aesthetic reward")))
        if set(state) != set(cls.KEYS):
            raise ValueError(
                f"aesthetic reward: {path} has keys {sorted(state)}; expected the LAION aesthetic MLP's "
                f"{list(cls.KEYS)}"
            )
        dims = [state["layers.0.weight"].shape[1]] + [
            state[f"layers.{i}.weight"].shape[0] for i in (0, 2, 4, 6)
        ]
        head = cls(dims)
        head.load_state_dict(state)
        return head
