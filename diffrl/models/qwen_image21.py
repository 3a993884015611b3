"""Qwen-Image 2.1 (`QwenImage21Pipeline`, and its Turbo checkpoint): the adapter (its tiny random
builder is `qwen_image21_tiny`).

Not Qwen-Image with another VAE: a new architecture behind a new pipeline, so this adapter shares
no code with `qwen_image`. What the diffusers pipeline does (diffusers 0.42), and so what this
adapter does:

- Text: a Qwen3-VL encoder (`Qwen3VLForConditionalGeneration`) reads the raw template
  `<|im_start|>system\\n{sys}<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>
  assistant\\n`, tokenized by the processor (left padding within a call); the last decoder
  layer's output *before* the final norm is kept for the real tokens, minus the system message's
  tokens. No truncation: the pipeline has no `max_sequence_length`, so `encode_prompts` refuses a
  prompt longer than it instead of cutting it. Only the processor's text side is used; where
  torchvision is missing (transformers 5 needs it for the processor's video part), diffrl loads
  it as `Qwen3VLTextProcessor` (the checkpoint's tokenizer and chat template, transformers' own
  code) without the image and video processors.
- Transformer: single-stream and block-causal: text tokens attend causally, the image block to all
  text and itself; with `causal_condition` the text is modulated at t = 0. The 3-axis RoPE places
  the image after *all* text tokens, padding included, so padding a prompt moves the image's
  position relative to the text: unlike Qwen-Image, where masked padding changes nothing, a padded
  row computes something else. The pipeline pads a call's prompts to the longest; diffrl runs each
  row at its own length instead (`velocity` groups the rows of a batch by text length, one forward
  per length, no padding, no mask), so a sample's velocity is the pipeline's for that prompt alone,
  whatever else shares its table, micro-batch or worker: the sampler and the trainer agree by
  construction. At the trained 1024 px a row is 4096 image tokens, big enough that one forward per
  length costs little; compiled blocks make one graph per (rows, length).
- Latents: fp32 [B, (H/16)·(W/16), 64]: the VAE downsamples 16x into 64 channels and the
  transformer takes them unpatched, flattened row-major (the pipeline's `_pack_latents`); H and
  W multiples of 32 (each image slot of the text sequence stands for 2x2 latent tokens).
- Network call: `transformer(hidden_states, timestep=t/1000, encoder_hidden_states,
  img_shapes=[[(1, H/16, W/16)]], img_mask=[False]·L + [True]·N/4)` (t = 1000·σ cast to the
  compute dtype first, as the pipeline), the velocity read off the last N output tokens. The
  pipeline's text KV cache (`use_kv_cache`) is not used: it computes the same up to rounding, and
  the trainer's grad forward cannot reuse it.
- CFG: plain true CFG, v_u + g·(v_c − v_u) with the pipeline's `true_cfg_scale` g (no norm
  rescale; the model card samples without guidance: g = 1, the pipeline's default). Both sides
  go through the length grouping above.
- Schedule: `set_timesteps(sigmas=grid, mu=calculate_shift(N))` with the scheduler config's shift
  constants; the grid is the checkpoint's `sample_sigmas` (the Turbo checkpoint ships its few-step
  grid) when the step count is its length, otherwise the pipeline's fallback linspace(1, 1/N, N).
  `pipeline_call` passes the grid explicitly, so the reference pipeline samples the same one.
- Decode: unflatten to [B, 64, 1, H/16, W/16], latents·std + mean, decode, frame 0. The VAE
  decodes RGBA; diffrl's pixels are the RGB channels (what PIL's convert("RGB") keeps of the
  pipeline's RGBA image).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3VLProcessor

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.schedules import Schedule, euler_config

#: Each image slot of the joint sequence stands for 2x2 latent tokens (the transformer's constant).
_TOKENS_PER_SLOT = 4
#: The timestep embedding's sinusoid width (fixed in diffusers).
_TIME_PROJ_DIM = 256


class Qwen3VLTextProcessor(Qwen3VLProcessor):
    """transformers' `Qwen3VLProcessor` with its tokenizer and chat template only: what
    `QwenImage21Pipeline` calls for text-to-image (tokenize, `apply_chat_template`) runs the
    processor's own code. Its image and video processors are left out: the video processor class
    needs torchvision, which diffrl does not require, and text-to-image never calls either."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name in ("image_processor", "video_processor"):
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Qwen3VLTextProcessor:
        """Load from a saved processor folder (its tokenizer files and chat template)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
        if template is None:
            raise ValueError(
                f"{folder} has no chat template (chat_template.jinja): it is not a Qwen3-VL processor"
            )
        processor = cls(
            image_processor=None, tokenizer=tokenizer, video_processor=None, chat_template=template
        )
        processor.source_folder = folder
        return processor

    def save_pretrained(self, save_directory, **kwargs):
        """The folder a real `Qwen3VLProcessor` loads (a full fine-tuning run's exported pipeline):
        the files of the folder this was loaded from (its image and video processor configs, which
        this class does not hold), then its tokenizer and chat template."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        source = getattr(self, "source_folder", None)
        if source is not None and Path(source).resolve() != folder.resolve():
            for file in Path(source).iterdir():
                if file.is_file():
                    shutil.copy2(file, folder / file.name)
        self.tokenizer.save_pretrained(folder)
        (folder / "chat_template.jinja").write_text(self.chat_template)
        return [str(folder)]


class QwenImage21Adapter(ModelAdapter):
    """Qwen-Image 2.1 text-to-image: a single-stream block-causal DiT (`QwenImage21TransformerBlock`s)
    on Qwen3-VL text features.

    `velocity(..., true_cfg_scale=g)`: the pipeline's true CFG, on when `cond.has_negative` and g > 1;
    `guidance_scale` is not this family's (the pipeline has none) and is ignored.
    """

    pipeline_class_name: ClassVar[str] = "QwenImage21Pipeline"
    # The pipeline does not cap the prompt; diffrl's cap on `max_sequence_length`.
    max_text_tokens: ClassVar[int] = 1024
    schedule_convention: ClassVar[str] = "qwen_image"
    latent_layout: ClassVar[str] = "the Qwen-Image 2.1 latent layout"
    block_class_names: ClassVar[tuple[str, ...]] = ("QwenImage21TransformerBlock",)
    # Each prompt length is its own graph (module docstring); a recompile allowance, not a bucket.
    text_length_buckets: ClassVar[int] = 64
    # Every block's attention projections and SwiGLU MLP: the transformer's own tensor-parallel
    # plan lists exactly these as its per-block weights (modulation is shared, not per block).
    default_lora_target_modules: ClassVar[tuple[str, ...]] = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "img_mlp.proj",
        "img_mlp.gate_layer",
        "img_mlp.out",
    )

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        config = pipe.transformer.config
        if config.patch_size != 1:
            raise ValueError(
                f"this Qwen-Image 2.1 transformer has patch_size={config.patch_size}; QwenImage21Pipeline "
                "feeds it unpatched latents (patch_size=1) only"
            )

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        """Where torchvision is missing, the processor's text side (`Qwen3VLTextProcessor`) from the
        checkpoint's files; otherwise diffusers loads the whole processor itself (as the edit
        families' `loaded_components`)."""
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():
            return {}
        return {"processor": Qwen3VLTextProcessor.from_folder(Path(path) / "processor")}

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` for each prompt (and negative): embeds [P, L, D] in the compute
        dtype, zero-padded to the call's longest with int64 masks [P, L] (1 = real token), both
        sides to one L. The padding is storage only: `velocity` runs each row at its own length.
        A prompt encoded to more than `max_sequence_length` tokens is refused (the pipeline does
        not truncate)."""
        prompts = self._prompt_batch(prompts, negative_prompts, max_sequence_length, "Qwen-Image 2.1")
        with torch.no_grad():
            sides = [self._encode(prompts, max_sequence_length)]
            if negative_prompts is not None:
                sides.append(self._encode(list(negative_prompts), max_sequence_length))
        length = max(embeds.shape[1] for embeds, _ in sides)
        (embeds, mask), *negative = [_pad_to(e, m, length) for e, m in sides]
        fields = {}
        if negative:
            fields["negative_embeds"], fields["negative_mask"] = negative[0]
        return PromptEmbeds(embeds=embeds, mask=mask, **fields, batch_size=[len(prompts)])

    def _encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One encoder call per prompt: a left-padded batch encodes a prompt up to rounding
        differently (7e-9 on the tiny model), and a prompt's embedding should not depend on the
        others of its call, just as its velocity does not (module docstring)."""
        rows = []
        for prompt in prompts:
            embeds, _, image_pad_mask = self.pipe.encode_prompt(prompt=[prompt], device=self.device)
            if image_pad_mask.any():
                raise ValueError(
                    f"prompt {prompt!r} holds a Qwen-VL image token (<|image_pad|>), which text-to-image "
                    "has no image for: remove it from the prompt"
                )
            if embeds.shape[1] > max_sequence_length:
                raise ValueError(
                    f"prompt {prompt!r} is {embeds.shape[1]} text tokens with the template, more than "
                    f"max_sequence_length={max_sequence_length}; QwenImage21Pipeline does not truncate "
                    "prompts, so diffrl does not either: raise rollout.pipeline.max_sequence_length or "
                    "shorten the prompt"
                )
            rows.append(embeds[0])
        length = max(len(r) for r in rows)
        embeds = torch.stack([F.pad(r, (0, 0, 0, length - len(r))) for r in rows])
        mask = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for i, r in enumerate(rows):
            mask[i, : len(r)] = 1
        return embeds, mask

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Only true CFG (`true_cfg_scale` > 1) runs a negative pass, as in the pipeline."""
        return true_cfg_scale is not None and true_cfg_scale > 1

    # ------------------------------------------------------------------------------ latents
    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """Latent (h, w) = (H/16, W/16); H and W must be multiples of 32 (a text slot is 2x2 tokens)."""
        if num_frames != 1:
            raise ValueError(f"Qwen-Image 2.1 generates images: num_frames must be 1; got {num_frames}")
        factor = self.pipe.vae_scale_factor
        multiple = factor * 2
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"Qwen-Image 2.1 needs height and width that are positive multiples of {multiple}; "
                f"got {height}x{width}"
            )
        return height // factor, width // factor

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        return (self.image_seq_len(height, width, num_frames), self.transformer.config.in_channels)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        h, w = self._latent_hw(height, width, num_frames)
        return h * w

    def init_noise(
        self, generators: Sequence[torch.Generator], height: int, width: int, num_frames: int = 1
    ) -> torch.Tensor:
        """fp32 [B, N, 64]: one [1, 1, 64, H/16, W/16] draw per generator, flattened, as the
        pipeline's `prepare_latents` draws it (the noise `pipe(generator=[...])` starts from)."""
        self._latent_hw(height, width, num_frames)
        generators = list(generators)
        latents, _ = self.pipe.prepare_latents(
            None,
            len(generators),
            self.transformer.config.in_channels,
            height,
            width,
            torch.float32,
            self.device,
            generators,
        )
        return latents.contiguous()

    def _sigma_grid(self, num_steps: int) -> np.ndarray:
        """The pipeline's grid before the shift: `sample_sigmas` of that length, else linspace."""
        grid = self.pipe.config.get("sample_sigmas")
        if grid is not None and len(grid) == num_steps:
            return np.asarray(grid, dtype=np.float64)
        return np.linspace(1.0, 1 / num_steps, num_steps)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> Schedule:
        """The pipeline's `set_timesteps(sigmas=grid, mu=calculate_shift(image tokens))` on a fresh
        scheduler from the model's config, with a final σ = 0 (module docstring)."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1; got {num_steps!r}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            euler_config(self.scheduler_config, self.schedule_convention)
        )
        config = scheduler.config
        mu = calculate_shift(
            self.image_seq_len(height, width, num_frames),
            config.base_image_seq_len,
            config.max_image_seq_len,
            config.base_shift,
            config.max_shift,
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            scheduler.set_timesteps(sigmas=self._sigma_grid(num_steps), mu=mu)
        sigmas = scheduler.sigmas.detach().to("cpu", torch.float32).clone()
        timesteps = scheduler.timesteps.detach().to("cpu", torch.float32).clone()
        if not (
            bool(torch.isfinite(sigmas).all()) and bool((sigmas[1:] < sigmas[:-1]).all()) and sigmas[-1] == 0
        ):
            raise ValueError(
                f"this scheduler config gives no usable schedule for num_steps={num_steps} (sigmas must be "
                f"finite and decrease to 0; got {sigmas.tolist()}); use more steps"
            )
        return Schedule(sigmas=sigmas, timesteps=timesteps)

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
        """The `QwenImage21Pipeline` call of these settings: true CFG with our negatives or
        `true_cfg_scale=1` (its default, off); the sigma grid explicitly; no text KV cache. The
        pipeline takes no `guidance_scale` and no `max_sequence_length`."""
        self._require_no_images(images)
        self._latent_hw(height, width, num_frames)
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale, true_cfg_scale)
        return dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if cfg else None,
            true_cfg_scale=true_cfg_scale if cfg else 1.0,
            num_inference_steps=num_inference_steps,
            sigmas=self._sigma_grid(num_inference_steps).tolist(),
            height=height,
            width=width,
            use_kv_cache=False,
        )

    def pipeline_latents(self, latents: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
        """The pipeline's final latents, one prompt per call: each prompt alone, unpadded, which is
        what `velocity` computes for its row (module docstring)."""
        pipe = self.reference_pipeline()
        negatives = call["negative_prompt"]
        rows = []
        for i, prompt in enumerate(call["prompt"]):
            one = dict(call, prompt=[prompt], negative_prompt=None if negatives is None else [negatives[i]])
            rows.append(pipe(latents=latents[i : i + 1], output_type="latent", **one).images)
        return torch.cat(rows)

    # ------------------------------------------------------------------------------ network
    def velocity(
        self,
        latents: torch.Tensor,
        timestep_B: torch.Tensor,
        cond: PromptEmbeds,
        guidance_scale: float,
        height: int,
        width: int,
        num_frames: int = 1,
        *,
        true_cfg_scale: float | None = None,
    ) -> torch.Tensor:
        """fp32 velocity [B, N, 64]: each row at its own text length (one forward per length among
        the rows, CFG's negatives included), true CFG combined in fp32 (module docstring)."""
        h, w = self._latent_hw(height, width, num_frames)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        batch, tokens = latents.shape[:2]
        hidden = latents.to(self.device, self.dtype)
        timestep = timestep_B.to(self.dtype)  # the pipeline casts to the compute dtype, then / 1000
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale, true_cfg_scale)
        texts = [(cond.embeds, cond.mask)]
        if do_cfg:  # rows [positives; negatives]
            texts.append((cond.negative_embeds, cond.negative_mask))
        embeds = torch.cat([e for e, _ in texts])
        lengths = torch.cat([_lengths(e, m) for e, m in texts]).tolist()
        order, outputs = [], []
        for length in sorted(set(lengths)):
            rows = [i for i, n in enumerate(lengths) if n == length]
            index = torch.tensor(rows, device=self.device)
            sample = index % batch
            img_mask = torch.zeros(len(rows), length + tokens // _TOKENS_PER_SLOT, dtype=torch.bool)
            img_mask[:, length:] = True
            out = self.run_transformer(
                hidden_states=hidden[sample],
                timestep=timestep[sample] / 1000,
                encoder_hidden_states=embeds[index, :length].to(self.device, self.dtype),
                encoder_hidden_states_mask=None,
                img_shapes=[[(1, h, w)]] * len(rows),
                img_mask=img_mask.to(self.device),
                attention_kwargs={},
                return_dict=False,
            )[0]
            outputs.append(out[:, -tokens:].float())
            order += rows
        out = torch.cat(outputs)[torch.argsort(torch.tensor(order, device=self.device))]
        if not do_cfg:
            return out
        v_cond, v_uncond = out.chunk(2)
        return v_uncond + true_cfg_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """uint8 [B, 3, H, W]: the pipeline's decode, RGB channels of its RGBA (module docstring)."""
        self._latent_hw(height, width, num_frames)
        vae = self.pipe.vae
        with torch.no_grad():
            z = self.pipe._unpack_latents(latents.to(self.device), height, width, self.pipe.vae_scale_factor)
            z = z.to(vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
            std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
            image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return to_uint8(image[:, :3])

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of every linear and of attention in one `QwenImage21Transformer2DModel` forward
        of `batch` rows at text length T = `text_len` (a CFG pair counts as 2 rows).

        With D = heads·head_dim, N image tokens, S = T + N, per row:
          inputs: N·C_in·D (img_in) + T·D_txt·D + T·D² (txt_in's two layers);
          per block: 4·S·D² (q, k, v, out) + 9·S·D² (SwiGLU, D -> 3D -> D)
            + 2·T²·D (text causally: the pipeline's exact prefill computes the text block dense)
            + 2·N·S·D (the image's queries over every key);
          output: S·D·C_out (proj_out, on every token of the joint sequence).
        Per time-embedding row: 256·D + D² (timestep MLP) + 4·D² (the shared modulation) + D²
        (norm_out), for the `batch` rows plus, with `causal_condition`, one t = 0 row per forward.
        Norms, RoPE, gates and softmax are elementwise and not counted.
        """
        if cond_tokens:
            raise ValueError("Qwen-Image 2.1 text-to-image takes no condition images: cond_tokens must be 0")
        cfg = self.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        n = self.image_seq_len(height, width, num_frames)
        t = text_len
        s = n + t
        per_row = n * cfg.in_channels * d + t * cfg.context_in_dim * d + t * d * d
        per_row += cfg.num_layers * ((4 + 3 * cfg.mlp_ratio) * s * d * d + 2 * t * t * d + 2 * n * s * d)
        per_row += s * d * cfg.out_channels
        time_rows = batch + (1 if cfg.causal_condition else 0)
        per_time_row = _TIME_PROJ_DIM * d + d * d + 4 * d * d + d * d
        return float(2 * (batch * per_row + time_rows * per_time_row))


def _lengths(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's real text length (all of it without a mask)."""
    if mask is None:
        return torch.full((embeds.shape[0],), embeds.shape[1], dtype=torch.long)
    return mask.sum(dim=1).cpu()


def _pad_to(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [P, l, D] embeds with zeros and [P, l] masks with 0 to `length`."""
    extra = length - embeds.shape[1]
    return F.pad(embeds, (0, 0, 0, extra)), F.pad(mask, (0, extra))


__all__ = ["Qwen3VLTextProcessor", "QwenImage21Adapter"]
