"""CLIP-family rewards: `clip_score`, `pickscore`, `aesthetic`. Weights come from local directories.

All three run a transformers `CLIPModel` with its `CLIPProcessor` (resize, crop, normalise,
tokenise) in eval mode, batched (`batch_size` images per forward), on the GPU when one is visible
(`device="auto"`; in a Ray reward worker that means `reward.gpus_per_worker > 0`), in bfloat16 there
and float32 on the CPU (`dtype="auto"`). Nothing is fetched from a hub: `from_pretrained` runs with
`local_files_only=True`, and a missing directory or file is a FileNotFoundError naming it.

A model directory is what `CLIPModel.save_pretrained` + `CLIPProcessor.save_pretrained` write
(or a hub snapshot of a CLIP repository):

    <model>/config.json                                   CLIPConfig
    <model>/model.safetensors                             weights (or pytorch_model.bin, or sharded + index)
    <model>/preprocessor_config.json | processor_config.json    image preprocessing
    <model>/tokenizer.json | vocab.json + merges.txt      tokenizer (clip_score, pickscore only)

Scores (per image; videos: mean over frames):

- `clip_score` (args `model`, `processor`): cos(image embedding, prompt embedding) in [-1, 1].
  Hessel et al.'s CLIP-S is 2.5 * max(cos, 0). Typical model: openai/clip-vit-large-patch14.
- `pickscore` (args `model`, `processor`): exp(logit_scale) * cos, PickScore's own scale (about
  15-25 for PickScore_v1, whose logit scale is ~100). Its processor lives in another repository
  (laion/CLIP-ViT-H-14-laion2B-s32B-b79K), hence the separate `processor` directory. Flow-GRPO
  divides PickScore by 26: use `weight: 0.0385` (1/26) to reproduce its reward scale.
- `aesthetic` (args `model`, `head`): the LAION aesthetic predictor v2 (improved-aesthetic-predictor),
  an MLP on the L2-normalised CLIP ViT-L/14 image embedding, about 1-10 (the AVA rating scale).
  Layout: the CLIP ViT-L/14 directory above plus the head's weights in
  `<model>/aesthetic_head.safetensors` (or any file given as `head`), with the keys of the
  original `sac+logos+ava1-l14-linearMSE.pth`: `layers.{0,2,4,6,7}.{weight,bias}`
  (Linear 768-1024, Dropout, Linear 1024-128, Dropout, Linear 128-64, Dropout, Linear 64-16,
  Linear 16-1). Convert the .pth once:
  `safetensors.torch.save_file(torch.load("sac+logos+ava1-l14-linearMSE.pth"), "aesthetic_head.safetensors")`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffrl.rewards.base import ImageReward, RewardOutput, auto_device, auto_dtype
from diffrl.rewards.registry import register_reward

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
AESTHETIC_HEAD_FILE = "aesthetic_head.safetensors"


def _require_dir(reward: str, arg: str, path: str | Path) -> Path:
    directory = Path(path).expanduser()
    if not str(path):
        raise ValueError(f"{reward} reward: args.{arg} is empty; set it to a local CLIP directory")
    if not directory.exists():
        raise FileNotFoundError(
            f"{reward} reward: args.{arg}={str(path)!r} does not exist; it must be a local directory saved "
            "by CLIPModel.save_pretrained (or a downloaded hub snapshot); nothing is fetched at run time"
        )
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{reward} reward: args.{arg}={str(path)!r} is a file; it must be a directory"
        )
    return directory


def _require_any(reward: str, directory: Path, names: tuple[str, ...], what: str) -> None:
    if not any((directory / name).is_file() for name in names):
        raise FileNotFoundError(
            f"{reward} reward: {directory} has no {what}: expected "
            + " or ".join(str(directory / n) for n in names)
        )


def check_clip_dirs(reward: str, model: str, processor: str | None, *, text: bool) -> tuple[Path, Path]:
    """The (model, processor) directories, checked to hold every file loading will need."""
    model_dir = _require_dir(reward, "model", model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{reward} reward: {model_dir / 'config.json'} is missing (the CLIPConfig)")
    _require_any(reward, model_dir, WEIGHT_FILES, "CLIP weights")
    processor_dir = model_dir if processor is None else _require_dir(reward, "processor", processor)
    _require_any(reward, processor_dir, IMAGE_PROCESSOR_FILES, "image processor config")
    if text and not (
        (processor_dir / "tokenizer.json").is_file()
        or all((processor_dir / n).is_file() for n in ("vocab.json", "merges.txt"))
    ):
        raise FileNotFoundError(
            f"{reward} reward: {processor_dir} has no CLIP tokenizer: expected tokenizer.json, or vocab.json "
            "and merges.txt"
        )
    return model_dir, processor_dir


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


class _PromptSimilarity(ImageReward):
    """cos(image, prompt) times `scale()`; the shared body of clip_score and pickscore."""

    def __init__(
        self,
        model: str,
        processor: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ) -> None:
        self.encoder = ClipEncoder(
            self.name, model, processor, text=True, device=device, dtype=dtype, batch_size=batch_size
        )

    def scale(self) -> float:
        return 1.0

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        images_ND = self.encoder.image_embeds(frames_N3HW)
        # Encode each distinct prompt once: a GRPO batch repeats every prompt n times.
        unique = list(dict.fromkeys(prompts_N))
        texts_UD = self.encoder.text_embeds(unique)
        index_N = torch.tensor([unique.index(p) for p in prompts_N])
        cosine_N = (images_ND * texts_UD[index_N]).sum(dim=-1)
        return RewardOutput(self.scale() * cosine_N.cpu())


@register_reward("clip_score")
class ClipScore(_PromptSimilarity):
    """cos(CLIP image embedding, CLIP prompt embedding), in [-1, 1].

    Args:
        model: local CLIP directory (config.json, weights, and the processor files unless `processor`).
        processor: directory of the CLIPProcessor files; default: `model`.
        device: "auto" (GPU if visible), "cpu", "cuda", "cuda:N".
        dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16", "float16".
        batch_size: images (and prompts) per forward pass.
    """

    name = "clip_score"


@register_reward("pickscore")
class PickScore(_PromptSimilarity):
    """PickScore: exp(logit_scale) * cos(image, prompt) of the PickScore_v1 CLIP-H model.

    Args as `clip_score`; `processor` is usually laion/CLIP-ViT-H-14-laion2B-s32B-b79K's directory.
    """

    name = "pickscore"

    def scale(self) -> float:
        return self.encoder.logit_scale


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

        state = load_file(str(path))
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


@register_reward("aesthetic")
class AestheticScore(ImageReward):
    """LAION aesthetic predictor v2: MLP(L2-normalised CLIP image embedding), about 1..10.

    Args:
        model: local CLIP ViT-L/14 directory (config.json, weights, preprocessor_config.json).
        head: the MLP's safetensors file; default `<model>/aesthetic_head.safetensors`.
        device, dtype, batch_size: as `clip_score` (the head always runs in float32).
    """

    name = "aesthetic"

    def __init__(
        self,
        model: str,
        head: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ) -> None:
        self.encoder = ClipEncoder(
            self.name, model, None, text=False, device=device, dtype=dtype, batch_size=batch_size
        )
        head_path = (
            Path(model).expanduser() / AESTHETIC_HEAD_FILE if head is None else Path(head).expanduser()
        )
        if not head_path.is_file():
            raise FileNotFoundError(
                f"aesthetic reward: the head weights {head_path} are missing; put the LAION aesthetic MLP "
                f"there as {AESTHETIC_HEAD_FILE} or set args.head (see docs/rewards.md for the conversion)"
            )
        self.head = AestheticHead.load(head_path).to(self.encoder.device).eval().requires_grad_(False)
        embed_dim = self.encoder.model.config.projection_dim
        if self.head.layers[0].in_features != embed_dim:
            raise ValueError(
                f"aesthetic reward: the head in {head_path} takes {self.head.layers[0].in_features}-d embeddings "
                f"but the CLIP in {model} makes {embed_dim}-d ones (the LAION head needs CLIP ViT-L/14, 768-d)"
            )

    @torch.inference_mode()
    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        embeds_ND = self.encoder.image_embeds(frames_N3HW)
        return RewardOutput(self.head(embeds_ND).squeeze(-1).float().cpu())
