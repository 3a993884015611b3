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

from pathlib import Path
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import ImageReward, RewardOutput
from diffrl.rewards.registry import register_reward

# Declaring these rewards (names, args, the directory checks) is what `diffrl config` validates;
# loading and running CLIP is torch and transformers, in diffrl.rewards.clip_models, which each
# reward's constructor imports. So validating a config never imports torch.
torch = lazy_import("torch")  # deferred: see diffrl.lazy

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
        from diffrl.rewards.clip_models import ClipEncoder

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
        from diffrl.rewards.clip_models import AestheticHead, ClipEncoder

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

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        # a context, not the `@torch.inference_mode()` decorator: that would load torch on import
        with torch.inference_mode():
            embeds_ND = self.encoder.image_embeds(frames_N3HW)
            return RewardOutput(self.head(embeds_ND).squeeze(-1).float().cpu())
