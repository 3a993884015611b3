"""FLUX.1 Kontext (`FluxKontextPipeline`): the FLUX.1 adapter plus one condition image per prompt.

Everything of FLUX.1 (`diffrl.models.flux`) holds: the transformer, packed 2x2 latents, the "flux"
schedule from the target's token count, the distilled guidance embedding (`guidance_scale`, 2.5 in
the Kontext model card) and the optional true CFG. The condition image enters as in the pipeline:

- Resize: the image's sides rounded down to multiples of 16 (`get_default_height_width`), then, with
  the pipeline's `_auto_resize` (its default), the trained resolution of the nearest aspect ratio
  (PREFERRED_KONTEXT_RESOLUTIONS, about one megapixel; `diffrl.models.conditions.kontext_size`);
  `pipe.image_processor.resize` and `preprocess` to [-1, 1].
- Encode: VAE posterior mode, `(z - shift_factor) · scaling_factor`, 2x2-packed
  (`pipe._encode_vae_image`, `pipe._pack_latents`): `PromptEmbeds.cond_latents` [P, N_c, 64]. The
  text embeddings are FLUX's, without the image.
- Velocity: the condition tokens are appended to the noisy tokens; their position ids are the
  pipeline's image ids with the first coordinate set to 1 (the target's are 0), appended to the
  target's; the velocity is the first H/16·W/16 output tokens. Both CFG sides see the image.

The output size is `rollout.pipeline.height x width`: the pipeline call passes `max_area=height·width`
(the pipeline otherwise rescales the requested size to `max_area`, one megapixel by default).

Pixel space: a pipeline saved without a VAE (the shapes edit task's toy model, `tiny:toy_edit`)
denoises pixels packed 2x2 (`FluxAdapter.pixel_space`), and its condition image is the image's own
pixels in [-1, 1], packed the same way at its own size (no resize). diffusers' pipeline cannot run
such a directory (it VAE-encodes the condition image), so `pipeline_call` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from diffrl.models.base import PromptEmbeds
from diffrl.models.conditions import KONTEXT_RESOLUTIONS, ConditionRule, kontext_size
from diffrl.models.flux import FluxAdapter, tiny_pipeline

#: FLUX.1 Kontext was trained up to this aspect ratio (1568x672, PREFERRED_KONTEXT_RESOLUTIONS).
KONTEXT_MAX_ASPECT = max(w / h for w, h in KONTEXT_RESOLUTIONS)


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext through diffusers' `FluxKontextPipeline` (module docstring)."""

    pipeline_class_name: ClassVar[str] = "FluxKontextPipeline"
    #: The pipeline's `_auto_resize`: condition images go to the nearest trained resolution.
    auto_resize: ClassVar[bool] = True
    condition_rule: ClassVar[ConditionRule] = ConditionRule(
        family="FluxKontextPipeline",
        min_images=1,
        max_images=1,
        max_aspect=KONTEXT_MAX_ASPECT,
        aspect_reason="its trained resolutions reach 1568x672, and the pipeline squeezes a wider image to that",
        encoded_size=kontext_size,
    )

    def encode_prompts(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None, max_sequence_length: int
    ) -> PromptEmbeds:
        raise ValueError(
            "FluxKontextPipeline edits images: every prompt needs its condition image (a prompt file's "
            "data.image_key field, or diffrl sample --image PATH)"
        )

    def encode_conditioned(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
        images: Sequence[Sequence[Any]],
    ) -> PromptEmbeds:
        """FLUX's text conditioning of the prompts plus each prompt's condition image, encoded as
        the pipeline encodes it (module docstring): `cond_latents` [P, N_c, 64], `cond_shapes`
        [P, 1, 2]. No grad."""
        images = [list(row) for row in images]
        if len(images) != len(prompts):
            raise ValueError(
                f"encode_conditioned got {len(prompts)} prompts and {len(images)} rows of condition images: "
                "pass one row of images per prompt"
            )
        text = super().encode_prompts(prompts, negative_prompts, max_sequence_length)
        latents, shapes = [], []
        done: dict[int, tuple[torch.Tensor, list[int]]] = {}  # an image shared by rows: one VAE pass
        with torch.no_grad():
            for row in images:
                if len(row) != 1:
                    raise ValueError(
                        f"FluxKontextPipeline takes exactly 1 condition image per prompt; got {len(row)}"
                    )
                (image,) = row
                if id(image) not in done:
                    encode = self._encode_pixels if self.pixel_space else self._encode_vae
                    done[id(image)] = encode(image)
                latents.append(done[id(image)][0])
                shapes.append([done[id(image)][1]])
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                f"the prompts' condition images give different condition sizes {shapes}: one batch needs "
                "one size; give the images one aspect ratio"
            )
        text.cond_latents = torch.cat(latents)
        text.cond_shapes = torch.tensor(shapes, dtype=torch.long, device=self.device)
        return text

    def _encode_vae(self, image: Any) -> tuple[torch.Tensor, list[int]]:
        """The pipeline's own condition path: Kontext's resize, the VAE, the 2x2 pack."""
        pipe = self.pipe
        width, height = kontext_size(
            *image.size, multiple_of=pipe.vae_scale_factor * 2, auto_resize=self.auto_resize
        )
        resized = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(resized, height, width)
        encoded = pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
        rows, cols = encoded.shape[2:]
        packed = pipe._pack_latents(encoded, 1, encoded.shape[1], rows, cols)
        return packed, [rows // 2, cols // 2]

    def _encode_pixels(self, image: Any) -> tuple[torch.Tensor, list[int]]:
        """Pixel space (no VAE, the shapes edit toy model): the image at its own size, in [-1, 1] as
        `encode` maps pixels, packed 2x2; no resize (the ~1 MP resize is the real model's training
        resolution, not a pixel-space model's)."""
        import numpy as np

        width, height = image.size
        if width % 2 or height % 2:
            raise ValueError(
                f"a pixel-space FluxKontextPipeline packs condition images 2x2: this one is {width}x{height}; "
                "use even sides"
            )
        pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).unsqueeze(0)
        return self.encode(pixels).to(self.dtype), [height // 2, width // 2]

    def _with_condition(
        self, hidden: torch.Tensor, img_ids: torch.Tensor, cond: PromptEmbeds, cfg: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cond.cond_latents is None or cond.cond_shapes is None:
            raise ValueError(
                "FluxKontextPipeline needs condition latents in its conditioning: encode the prompts with "
                "their images (ModelAdapter.encode_conditioned)"
            )
        if not bool((cond.cond_shapes == cond.cond_shapes[:1]).all()):
            raise ValueError(
                "the rows of one batch have condition images of different sizes; one batch needs one"
            )
        latents = cond.cond_latents.to(self.device, self.dtype)
        if cfg:
            latents = torch.cat([latents, latents])
        rows, cols = cond.cond_shapes[0, 0].tolist()
        image_ids = self.pipe._prepare_latent_image_ids(1, rows, cols, self.device, self.dtype)
        image_ids[..., 0] = 1  # the pipeline: condition ids are the latent ids with the first coordinate 1
        return torch.cat([hidden, latents], dim=1), torch.cat([img_ids, image_ids], dim=0)

    @property
    def no_pipeline_reference(self) -> str | None:
        if self.pixel_space:
            return (
                "this FluxKontextPipeline has no VAE (pixel space, the shapes edit toy model), and diffusers' "
                "pipeline VAE-encodes its condition image: there is no pipeline call to compare the sampler with"
            )
        return None

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
        """FLUX's call plus `image` (one per prompt), `max_area=height·width` (module docstring) and
        `_auto_resize`."""
        if images is None or len(images) != len(prompts):
            raise ValueError("FluxKontextPipeline needs one condition image per prompt")
        if self.no_pipeline_reference:
            raise ValueError(self.no_pipeline_reference)
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
        call.update(image=[row[0] for row in images], max_area=height * width, _auto_resize=self.auto_resize)
        return call


def build_tiny(path: Path, seed: int = 0) -> Path:
    """A tiny random `FluxKontextPipeline`: the tiny FLUX.1-dev components
    (`diffrl.models.flux.tiny_pipeline`), no IP-adapter image encoder, written to `path`."""
    path = Path(path)
    tiny_pipeline(seed, "FluxKontextPipeline").save_pretrained(path)
    return path
