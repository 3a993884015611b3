"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit-2509/2511
(`QwenImageEditPlusPipeline`, one to three condition images): adapters and tiny random builders.

Both are Qwen-Image (`diffrl.models.qwen_image`: the same transformer, VAE, schedule, true CFG with
norm rescale, decode) plus condition images, which enter twice, exactly as in the pipelines:

- Text: the Qwen2.5-VL text encoder sees the image(s) with the prompt, through the pipeline's
  `processor` and its edit prompt template (`pipe.encode_prompt(prompt, image)`); the negative prompt
  is encoded with the same image(s). The embeddings therefore depend on (prompt, images), and
  `encode_conditioned` computes them one prompt at a time: the Plus pipeline takes one prompt per
  call (its template numbers the images "Picture 1: ..."), and one at a time a row's conditioning
  does not depend on which prompts share its batch. Rows are then padded to one length, a multiple
  of `TEXT_BUCKET`, as in `QwenImageAdapter.encode_prompts`. The edit pipelines do not cut the text
  at `max_sequence_length` (the image tokens are part of it); it must only be <= 1024, as they check.
- Latents: each condition image is resized, VAE-encoded (posterior mode), normalised with the VAE's
  latents_mean/std and 2x2-packed (`pipe._encode_vae_image`, `pipe._pack_latents`): those are
  `PromptEmbeds.cond_latents` [P, N_c, 64], and each image's packed grid is `cond_shapes`.
  `velocity` appends them to the noisy tokens, passes `img_shapes = [(1, H/16, W/16), (1, h_1, w_1),
  ...]` (the RoPE grids: the target first, each condition image next) and keeps the first H/16·W/16
  output tokens, as the pipelines' loops do.

Resizing. QwenImageEditPipeline: the image is resized (Lanczos, `pipe.image_processor.resize`) to
about 1024² pixels at its aspect ratio, sides multiples of 32 (`calculate_dimensions`); that resized
image goes to both the VAE and the text encoder. QwenImageEditPlusPipeline: each image goes to the
VAE at about 1024² pixels and, separately resized, to the text encoder at about 384² pixels.

The processor. transformers 5 builds `Qwen2VLProcessor` with a video processor, whose class needs
torchvision. Where torchvision is missing (CPU machines often lack it), `loaded_components` loads the
processor's image processor and tokenizer into `ImageOnlyQwen2VLProcessor`, a subclass without the
video part: the same `__call__`, so the same token ids and pixel values for images.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from transformers import Qwen2VLProcessor

from diffrl.models.base import PromptEmbeds
from diffrl.models.conditions import ConditionRule, qwen_edit_dimensions
from diffrl.models.qwen_image import TEXT_BUCKET, QwenImageAdapter, _pad_text
from diffrl.models.qwen_image_tiny import tiny_pipeline

#: Pixels of the image the VAE encodes (both pipelines' 1024 * 1024) and, in the Plus pipeline, of
#: the image the text encoder sees (CONDITION_IMAGE_SIZE, 384 * 384).
VAE_IMAGE_AREA = 1024 * 1024
VL_IMAGE_AREA = 384 * 384
#: Qwen2.5-VL's image processor refuses aspect ratios of 200 or more (`smart_resize`).
QWEN_VL_MAX_ASPECT = 199.0


def _vae_size(width: int, height: int) -> tuple[int, int]:
    return qwen_edit_dimensions(VAE_IMAGE_AREA, width, height)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor (see the module docstring): transformers checks
    every processor part's class, and the video processor's class needs torchvision. Images and text
    go through the parent's own `__call__`."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):
        """The folder a real `Qwen2VLProcessor` loads: tokenizer, image processor, and the video
        processor's config (the same sizes as the image processor's)."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)
        image_config = json.loads((folder / "preprocessor_config.json").read_text())
        video_config = {
            **{k: v for k, v in image_config.items() if k != "image_processor_type"},
            "video_processor_type": "Qwen2VLVideoProcessor",
            "processor_class": "Qwen2VLProcessor",
        }
        (folder / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2) + "\n")
        (folder / "processor_config.json").write_text(
            json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n"
        )
        return [str(folder)]


def load_processor(folder: Path) -> Qwen2VLProcessor:
    """The pipeline's `processor` folder as an `ImageOnlyQwen2VLProcessor` (no torchvision needed)."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor

    return ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
        tokenizer=Qwen2Tokenizer.from_pretrained(folder),
    )


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: one condition image per prompt (module docstring)."""

    pipeline_class_name = "QwenImageEditPipeline"
    latent_layout = "the packed Qwen-Image layout"
    # Qwen-Image-Edit-2511 conditions with timestep 0 on the condition tokens: the transformer does
    # it itself from img_shapes, so the adapter passes the same inputs either way.
    variant_flags = ("zero_cond_t",)
    # The text holds the image's tokens too, so it may pass the 1024 of text-to-image.
    text_length_buckets = 4096 // TEXT_BUCKET
    condition_rule: ClassVar[ConditionRule] = ConditionRule(
        family="QwenImageEditPipeline",
        min_images=1,
        max_images=1,
        max_aspect=QWEN_VL_MAX_ASPECT,
        aspect_reason="Qwen2.5-VL's image processor refuses aspect ratios of 200:1 or more",
        encoded_size=_vae_size,
    )

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():
            return {}  # diffusers loads the processor itself, video part included
        return {"processor": load_processor(Path(path) / "processor")}

    def init_noise(
        self, generators: Sequence[torch.Generator], height: int, width: int, num_frames: int = 1
    ) -> torch.Tensor:
        """fp32 packed noise [B, (H/16)·(W/16), 64], drawn by the edit pipeline's `prepare_latents`
        (as Qwen-Image's, `QwenImageAdapter.init_noise`; its first argument is the condition image)."""
        self._latent_hw(height, width, num_frames)
        generators = list(generators)
        latents, _ = self.pipe.prepare_latents(
            None,
            len(generators),
            self.transformer.config.in_channels // 4,
            height,
            width,
            torch.float32,
            self.device,
            generators,
        )
        return latents

    # ------------------------------------------------------------------------------ conditioning
    def encode_prompts(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None, max_sequence_length: int
    ) -> PromptEmbeds:
        raise ValueError(
            f"{self.pipeline_class_name} edits images: every prompt needs its condition image(s) "
            "(a prompt file's data.image_key field, or diffrl sample --image PATH)"
        )

    def encode_conditioned(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
        images: Sequence[Sequence[Any]],
    ) -> PromptEmbeds:
        """Embeds [P, L, D] and masks [P, L] (both CFG sides when `negative_prompts` is given) of
        each prompt with its images, and the images' packed latents `cond_latents` [P, N_c, 64] with
        their grids `cond_shapes` [P, K, 2] (module docstring). No grad."""
        prompts, images = list(prompts), [list(row) for row in images]
        if not prompts or len(images) != len(prompts):
            raise ValueError(
                f"encode_conditioned got {len(prompts)} prompts and {len(images)} rows of condition images: "
                "pass one row of images per prompt"
            )
        if not 1 <= max_sequence_length <= self.pipe.tokenizer_max_length:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} is out of range for {self.pipeline_class_name}: "
                f"use 1..{self.pipe.tokenizer_max_length} (the edit pipelines do not truncate the text)"
            )
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: pass one per prompt"
            )
        rule = self.condition_rule
        sides: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
        latents, shapes = [], []
        encoded: dict[int, tuple[torch.Tensor, list[int]]] = {}  # an image shared by rows: one VAE pass
        with torch.no_grad():
            for i, (prompt, row) in enumerate(zip(prompts, images, strict=True)):
                if not rule.min_images <= len(row) <= rule.max_images:
                    raise ValueError(
                        f"prompt {prompt!r} has {len(row)} condition image(s); {rule.family} takes "
                        f"{rule.count_text()}"
                    )
                text_images = self._text_images(row)
                sides[0].append(self._encode_text(prompt, text_images))
                if negative_prompts is not None:
                    sides[1].append(self._encode_text(negative_prompts[i], text_images))
                for image in row:
                    if id(image) not in encoded:
                        encoded[id(image)] = self._encode_image(image)
                latents.append(torch.cat([encoded[id(image)][0] for image in row], dim=1))
                shapes.append([encoded[id(image)][1] for image in row])
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                f"the prompts' condition images give different condition token grids {shapes}: one batch "
                "needs one size; give the images one aspect ratio"
            )
        longest = max(e.shape[1] for side in sides for e, _ in side)
        length = -(-longest // TEXT_BUCKET) * TEXT_BUCKET
        padded = [[_pad_text(e, m, length) for e, m in side] for side in sides]
        negative = bool(padded[1])
        return PromptEmbeds(
            embeds=torch.cat([e for e, _ in padded[0]]),
            mask=torch.cat([m for _, m in padded[0]]),
            negative_embeds=torch.cat([e for e, _ in padded[1]]) if negative else None,
            negative_mask=torch.cat([m for _, m in padded[1]]) if negative else None,
            cond_latents=torch.cat(latents),
            cond_shapes=torch.tensor(shapes, dtype=torch.long, device=self.device),
            batch_size=[len(prompts)],
        )

    def _text_images(self, row: list[Any]) -> Any:
        """What the text encoder sees of one prompt's images: in `QwenImageEditPipeline.__call__`,
        its single image resized for the VAE (`_vae_input`)."""
        (image,) = row
        width, height = _vae_size(*image.size)
        return self.pipe.image_processor.resize(image, height, width)

    def _vae_input(self, image: Any) -> torch.Tensor:
        """[1, 3, 1, h, w] in [-1, 1]: the image resized to ~1024² (Lanczos), as both pipelines."""
        width, height = _vae_size(*image.size)
        processor = self.pipe.image_processor
        return processor.preprocess(processor.resize(image, height, width), height, width).unsqueeze(2)

    def _encode_text(self, prompt: str, text_images: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(prompt=[prompt], image=text_images, device=self.device)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def _encode_image(self, image: Any) -> tuple[torch.Tensor, list[int]]:
        """[1, N, 64] packed latents of one condition image (the pipelines' `prepare_latents`; the
        Plus pipeline concatenates a row's images along the tokens) and its packed grid."""
        pipe = self.pipe
        pixels = self._vae_input(image).to(device=self.device, dtype=self.dtype)
        latents = pipe._encode_vae_image(image=pixels, generator=None)  # posterior mode: no draw
        rows, cols = latents.shape[3:]
        return pipe._pack_latents(latents, 1, latents.shape[1], rows, cols), [rows // 2, cols // 2]

    def _with_condition(
        self,
        hidden_states: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        cond: PromptEmbeds,
        cfg: bool,
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        latents = _condition_latents(cond, self.pipeline_class_name).to(self.device, self.dtype)
        if cfg:
            latents = torch.cat([latents, latents])
        grids = [(1, rows, cols) for rows, cols in cond.cond_shapes[0].tolist()]
        return torch.cat([hidden_states, latents], dim=1), [*img_shapes, *grids]

    # ------------------------------------------------------------------------------ the reference
    def pipeline_call(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        *,
        num_inference_steps: int,
        guidance_scale: float,
        true_cfg_scale: float | None,
        height: int,
        width: int,
        num_frames: int,
        max_sequence_length: int,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> dict[str, Any]:
        """The edit pipeline's call: Qwen-Image's (true CFG with our negatives) plus `image`, one
        per prompt; `pipeline_latents` calls the pipeline once per prompt."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{self.pipeline_class_name} needs one row of condition images per prompt")
        call = super().pipeline_call(
            prompts,
            negative_prompts,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            true_cfg_scale=true_cfg_scale,
            height=height,
            width=width,
            num_frames=num_frames,
            max_sequence_length=max_sequence_length,
        )
        call["image"] = [row[0] for row in images]
        return call

    def pipeline_latents(self, latents: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
        """The pipeline's final latents, one prompt per call: QwenImageEditPlusPipeline refuses
        batches, and QwenImageEditPipeline given a list of images skips the resize of the images
        its text encoder sees (`image_processor.resize` passes lists through), which a single image
        gets: one image per call is the pipeline's documented use, `pipe(image, prompt)`."""
        out = []
        for i, prompt in enumerate(call["prompt"]):
            negative = call["negative_prompt"]
            one = {
                **call,
                "prompt": [prompt],
                "image": call["image"][i],
                "negative_prompt": None if negative is None else [negative[i]],
            }
            out.append(
                self.reference_pipeline()(latents=latents[i : i + 1], output_type="latent", **one).images
            )
        return torch.cat(out)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-2509 / 2511: one to three condition images per prompt (module docstring)."""

    pipeline_class_name = "QwenImageEditPlusPipeline"
    condition_rule: ClassVar[ConditionRule] = ConditionRule(
        family="QwenImageEditPlusPipeline",
        min_images=1,
        # The pipeline takes any number, each "Picture k" in the prompt; Qwen-Image-Edit-2509 was
        # trained with one to three (its model card), and each adds ~4096 image tokens at 1024².
        max_images=3,
        max_aspect=QWEN_VL_MAX_ASPECT,
        aspect_reason="Qwen2.5-VL's image processor refuses aspect ratios of 200:1 or more",
        encoded_size=_vae_size,
    )

    def _text_images(self, row: list[Any]) -> Any:
        """As `QwenImageEditPlusPipeline.__call__`: each image resized to ~384² for the text encoder."""
        processor = self.pipe.image_processor
        return [
            processor.resize(image, *qwen_edit_dimensions(VL_IMAGE_AREA, *image.size)[::-1]) for image in row
        ]

    def _vae_input(self, image: Any) -> torch.Tensor:
        """As `QwenImageEditPlusPipeline.__call__`: the original image to ~1024² by `preprocess`
        alone (Qwen-Image-Edit resizes first, then preprocesses)."""
        width, height = _vae_size(*image.size)
        return self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)

    def pipeline_call(self, prompts, negative_prompts, *, images=None, **settings) -> dict[str, Any]:
        """As Qwen-Image-Edit's, with each prompt's list of images."""
        call = super().pipeline_call(prompts, negative_prompts, images=images, **settings)
        call["image"] = [list(row) for row in images]
        return call


def _condition_latents(cond: PromptEmbeds, family: str) -> torch.Tensor:
    if cond.cond_latents is None or cond.cond_shapes is None:
        raise ValueError(
            f"{family} needs condition latents in its conditioning: encode the prompts with their images "
            "(ModelAdapter.encode_conditioned)"
        )
    if not bool((cond.cond_shapes == cond.cond_shapes[:1]).all()):
        raise ValueError(
            f"{family}: the rows of one batch have condition images of different sizes "
            f"{sorted({tuple(map(tuple, s)) for s in cond.cond_shapes.tolist()})}; one batch needs one size"
        )
    return cond.cond_latents


# ---------------------------------------------------------------------------------- tiny builders
#: The tiny tokenizer's vocabulary for the edit templates: enough merges that the template's system
#: part is 64 tokens, the count the pipelines drop (as with the real tokenizer).
TINY_EDIT_VOCAB_SIZE = 640


def _tiny_processor(tokenizer) -> ImageOnlyQwen2VLProcessor:
    """Qwen2.5-VL's image processor, with a pixel budget of 112² (the real one: 12.8 M) so that a
    tiny model's condition image is a few tokens: 8x8 patches of 14 pixels, 16 tokens after the 2x2
    merge."""
    from transformers import Qwen2VLImageProcessor

    return ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112), tokenizer=tokenizer
    )


def save_pipeline(pipe, path: Path) -> Path:
    """`pipe.save_pretrained(path)`, naming a processor built as `ImageOnlyQwen2VLProcessor` by its
    real class in model_index.json (the image-only subclass is how this process built it, not what
    the directory holds). Also saves pipelines without one (`benchmarks/random_pipelines.py`)."""
    path = Path(path)
    pipe.save_pretrained(path)
    if not isinstance(getattr(pipe, "processor", None), ImageOnlyQwen2VLProcessor):
        return path
    index_file = path / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def build_tiny(path: Path, seed: int = 0) -> Path:
    """A tiny random `QwenImageEditPipeline` (Qwen-Image's tiny transformer, Qwen2.5-VL text encoder
    and VAE at half width, `diffrl.models.qwen_image_tiny.tiny_pipeline`, plus a processor) written to
    `path`."""
    return save_pipeline(
        tiny_pipeline(QwenImageEditPipeline, seed, TINY_EDIT_VOCAB_SIZE, 4, processor=_tiny_processor), path
    )


def build_tiny_plus(path: Path, seed: int = 0) -> Path:
    """A tiny random `QwenImageEditPlusPipeline` (as `build_tiny`) written to `path`."""
    return save_pipeline(
        tiny_pipeline(QwenImageEditPlusPipeline, seed, TINY_EDIT_VOCAB_SIZE, 4, processor=_tiny_processor),
        path,
    )
