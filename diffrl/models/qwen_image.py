"""Qwen-Image (`QwenImagePipeline`): the adapter (its tiny random builder is `qwen_image_tiny`).

What the diffusers pipeline does, and therefore what this adapter does:

- Text: the prompt goes through a chat template (`pipe.prompt_template_encode`), the Qwen2.5-VL
  text encoder runs over it, its last hidden layer is kept for the real tokens only, and the
  template's first `pipe.prompt_template_encode_start_idx` (34) tokens are dropped. The result has
  a variable length per prompt: `pipe.encode_prompt` pads a call's prompts to the longest with
  zeros and returns the mask (or None when no row is padded). `encode_prompts` keeps a mask always
  (`PromptEmbeds.mask` / `negative_mask`, int64 like the pipeline's, 1 = real token) and pads the
  positive and negative rows of one call to one common length, so that CFG can batch them. That
  length is rounded up to a multiple of `TEXT_BUCKET` tokens: compiled blocks have static shapes,
  and a length that followed each batch's longest prompt made a new graph for nearly every batch
  until dynamo's recompile limit sent the rest to eager (a compiled 20B Qwen-Image then sampled at
  23% MFU on an H200). Padded keys are masked out, so the result is the same up to float rounding.
- Latents: 2x2-packed tokens, fp32 [B, (H/16)·(W/16), 64] (16 VAE channels x 2 x 2; the VAE
  downsamples by 8, the packing by 2). `init_noise` draws them as the pipeline's `prepare_latents`
  does (an unpacked [1, 1, 16, H/8, W/8] draw per generator, then `_pack_latents`), so a generator
  gives the same initial noise as `pipe(generator=...)`.
- Network call (one step of the pipeline's loop): `transformer(hidden_states=latents,
  timestep=t/1000, encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
  img_shapes=[[(1, H/16, W/16)]]·B, guidance=None)`, with t the scheduler's timestep (1000·σ)
  cast to the compute dtype before the division, as the pipeline does. In diffusers 0.42 the
  forward takes the mask (it builds the joint text+image attention mask from it and uses the
  padded text length for the text RoPE positions, so right-padding does not move real tokens).
- CFG: Qwen-Image uses *true* CFG with norm rescale, driven by the pipeline's `true_cfg_scale`
  (its `guidance_scale` is for guidance-distilled variants, which this adapter rejects, so the
  `guidance_scale` argument of `velocity` is ignored). With `velocity(..., true_cfg_scale=g)`:

      v = v_u + g·(v_c − v_u);   v ← v·‖v_c‖/‖v‖   (2-norm over the last, packed-channel dim, per token)

  computed from ONE batched forward of [negative, positive] (the pipeline runs two forwards; the
  two sides are padded to one text length with their masks, which gives the same result up to
  float rounding because padded keys are masked out). The combination runs in fp32 on the
  network's output cast to fp32 (the pipeline combines in the compute dtype; identical in fp32).
- Schedule: "qwen_image" convention (dynamic shift from the packed token count, shift_terminal
  0.02, exponential time shift), see `diffrl.schedules`.
- Decode: `_unpack_latents` to [B, 16, 1, H/8, W/8] (the VAE is a video VAE with a frame dim),
  de-normalise with the VAE config's latents_mean / latents_std, decode, take frame 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import QwenImagePipeline

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8

# Text lengths are padded to a multiple of this many tokens (see the module docstring).
TEXT_BUCKET = 32


class QwenImageAdapter(ModelAdapter):
    """Qwen-Image text-to-image (MMDiT with dual-stream `QwenImageTransformerBlock`s).

    `velocity(..., true_cfg_scale=g)`: Qwen-Image's true CFG (`true_cfg_scale` of the diffusers
    pipeline), applied with norm rescale when `cond.has_negative` and g > 1.
    """

    pipeline_class_name = "QwenImagePipeline"
    max_text_tokens = 1024  # the pipeline tokenizer_max_length
    schedule_convention = "qwen_image"
    latent_layout = "the packed Qwen-Image layout"
    block_class_names = ("QwenImageTransformerBlock",)
    text_length_buckets = 1024 // TEXT_BUCKET  # up to the tokenizer's 1024 tokens
    # Both streams' attention projections and MLPs: the Qwen-Image Flow-GRPO LoRA recipe (VeRL-Omni).
    default_lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )

    #: Transformer variant flags this family's pipeline drives (the others are other pipelines').
    variant_flags: tuple[str, ...] = ()

    def __init__(self, pipe: QwenImagePipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        config = pipe.transformer.config
        if config.guidance_embeds:
            raise ValueError(
                "this Qwen-Image transformer has guidance_embeds=True (a guidance-distilled variant); "
                "diffrl's Qwen-Image adapter samples with true CFG only: use a checkpoint with guidance_embeds=False"
            )
        flags = [
            f
            for f in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
            if config.get(f) and f not in self.variant_flags
        ]
        if flags:
            raise ValueError(
                f"this Qwen-Image transformer uses {' / '.join(flags)} (edit or layered variants), which "
                f"{self.pipeline_class_name} does not drive: load the model directory its model_index.json "
                "pipeline class belongs to"
            )

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` for the prompts (and the negatives), padded to one length L.

        Returns embeds [P, L, D] in the compute dtype and int64 masks [P, L] (1 = real token), for
        both sides when `negative_prompts` is given. L is the longest encoded prompt of the call
        (capped at `max_sequence_length`, as the pipeline caps it; at most 1024) rounded up to a
        multiple of `TEXT_BUCKET`, but not past `max_sequence_length` (module docstring).
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        if not 1 <= max_sequence_length <= self.pipe.tokenizer_max_length:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} is out of range for Qwen-Image: "
                f"use 1..{self.pipe.tokenizer_max_length}"
            )
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: pass one per prompt"
            )
        with torch.no_grad():
            sides = [self._encode(prompts, max_sequence_length)]
            if negative_prompts is not None:
                sides.append(self._encode(list(negative_prompts), max_sequence_length))
        longest = max(embeds.shape[1] for embeds, _ in sides)
        length = max(longest, min(-(-longest // TEXT_BUCKET) * TEXT_BUCKET, max_sequence_length))
        embeds, mask = _pad_text(*sides[0], length)
        negative_embeds = negative_mask = None
        if len(sides) > 1:
            negative_embeds, negative_mask = _pad_text(*sides[1], length)
        return PromptEmbeds(
            embeds=embeds,
            mask=mask,
            negative_embeds=negative_embeds,
            negative_mask=negative_mask,
            batch_size=[len(prompts)],
        )

    def _encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    # ------------------------------------------------------------------------------ latents
    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """Unpacked latent (h, w) = (H/8, W/8); H and W must be multiples of 16 (8 x the 2x2 packing)."""
        if num_frames != 1:
            raise ValueError(f"Qwen-Image makes images: num_frames must be 1, got {num_frames}")
        multiple = self.pipe.vae_scale_factor * 2
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"Qwen-Image needs height and width that are positive multiples of {multiple}; "
                f"got {height}x{width}"
            )
        return height // self.pipe.vae_scale_factor, width // self.pipe.vae_scale_factor

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        return (self.image_seq_len(height, width, num_frames), self.transformer.config.in_channels)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        h, w = self._latent_hw(height, width, num_frames)
        return (h // 2) * (w // 2)

    def init_noise(
        self, generators: Sequence[torch.Generator], height: int, width: int, num_frames: int = 1
    ) -> torch.Tensor:
        """fp32 packed noise [B, (H/16)·(W/16), 64], drawn by the pipeline's `prepare_latents`.

        One unpacked draw per generator (so a sample's noise does not depend on its micro-batch),
        then `_pack_latents`: the same noise `pipe(generator=[...])` starts from in fp32.
        """
        self._latent_hw(height, width, num_frames)
        generators = list(generators)
        return self.pipe.prepare_latents(
            len(generators),
            self.transformer.config.in_channels // 4,
            height,
            width,
            torch.float32,
            self.device,
            generators,
        )

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Only true CFG runs a negative pass (`guidance_scale` belongs to distilled variants)."""
        return true_cfg_scale is not None and true_cfg_scale > 1

    # ------------------------------------------------------------------------------ network
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
        """The `QwenImagePipeline` call of these settings: true CFG with our negatives, or
        `true_cfg_scale=1` (the pipeline's default is 4, on); `guidance_scale` is not passed (this
        adapter ignores it, as the pipeline does for a model without a guidance embedding). The
        edit pipelines add their condition images."""
        self._require_no_images(images)
        if num_frames != 1:
            raise ValueError(f"Qwen-Image generates images: num_frames must be 1; got {num_frames}")
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale, true_cfg_scale)
        return dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if cfg else None,
            true_cfg_scale=true_cfg_scale if cfg else 1.0,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )

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
        """fp32 velocity [B, N, 64]; true CFG with norm rescale when `true_cfg_scale` > 1 (module docstring)."""
        h, w = self._latent_hw(height, width, num_frames)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        batch = latents.shape[0]
        hidden_states = latents.to(self.device, self.dtype)
        timestep = torch.as_tensor(timestep_B, device=self.device).to(self.dtype).expand(batch)
        # CFG as one batched call ([negatives; prompts], then chunk and combine): the same block is
        # in sd3.py, flux.py, wan.py. The families differ in their inputs and combine rule
        # (here: true CFG with norm rescale), so each adapter keeps its own copy.
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale, true_cfg_scale)
        if do_cfg:
            length = max(cond.embeds.shape[1], cond.negative_embeds.shape[1])
            negative = _pad_text(
                cond.negative_embeds, _mask_or_ones(cond.negative_embeds, cond.negative_mask), length
            )
            positive = _pad_text(cond.embeds, _mask_or_ones(cond.embeds, cond.mask), length)
            encoder_hidden_states = torch.cat([negative[0], positive[0]])
            encoder_mask = torch.cat([negative[1], positive[1]])
            hidden_states = torch.cat([hidden_states, hidden_states])
            timestep = torch.cat([timestep, timestep])
        else:
            encoder_hidden_states, encoder_mask = cond.embeds, cond.mask
        tokens = hidden_states.shape[1]
        hidden_states, img_shapes = self._with_condition(hidden_states, [(1, h // 2, w // 2)], cond, do_cfg)
        noise_pred = self.run_transformer(
            hidden_states=hidden_states,
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=None if encoder_mask is None else encoder_mask.to(self.device),
            encoder_hidden_states=encoder_hidden_states.to(self.device, self.dtype),
            img_shapes=[img_shapes] * hidden_states.shape[0],
            attention_kwargs={},
            return_dict=False,
        )[0][:, :tokens].float()
        if not do_cfg:
            return noise_pred
        v_uncond, v_cond = noise_pred.chunk(2)
        combined = v_uncond + true_cfg_scale * (v_cond - v_uncond)
        cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    def _with_condition(
        self,
        hidden_states: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        cond: PromptEmbeds,
        cfg: bool,
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The transformer's image tokens and `img_shapes` entry (one (frames, rows, columns) grid
        per image, which sets the RoPE positions): the noisy latents only (text-to-image). The edit
        families append their condition tokens and grids here; the velocity is read off the first
        `image_seq_len` output tokens either way."""
        return hidden_states, img_shapes

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed latents -> uint8 [B, 3, H, W], exactly as the pipeline's `output_type != "latent"` path."""
        self._latent_hw(height, width, num_frames)
        vae = self.pipe.vae
        with torch.no_grad():
            latents = self.pipe._unpack_latents(
                latents.to(self.device), height, width, self.pipe.vae_scale_factor
            )
            latents = latents.to(vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            latents_mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
            latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(
                latents.device, latents.dtype
            )
            latents = latents / latents_std + latents_mean
            image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return to_uint8(image)

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of one transformer forward over `batch` samples (a CFG pair counts as 2).

        Per sample, with D = heads·head_dim, N image tokens (the noisy latents' plus `cond_tokens`
        condition-image tokens of the edit families, which go through the same image-stream
        weights), T text tokens (padded length):
          embeddings: N·C_in·D (img_in) + T·D_txt·D (txt_in) + 256·D + D² (timestep MLP)
          per dual-stream block: 2·6D² (img_mod, txt_mod on the time embedding)
            + (N + T)·4D² (q, k, v, out: each stream's own weights on its own tokens)
            + 2·(N + T)²·D (joint attention QK^T and AV over all tokens)
            + (N + T)·8D² (each stream's MLP, D -> 4D -> D)
          output: 2D² (norm_out modulation) + N·D·p²·C_out (proj_out)
        Elementwise work (norms, RoPE, gates, softmax) is not counted.
        """
        config = self.transformer.config
        dim = config.num_attention_heads * config.attention_head_dim
        n = self.image_seq_len(height, width, num_frames) + cond_tokens
        t = text_len
        tokens = n + t
        macs = n * config.in_channels * dim + t * config.joint_attention_dim * dim + 256 * dim + dim * dim
        per_block = (
            2 * 6 * dim * dim + tokens * 4 * dim * dim + 2 * tokens * tokens * dim + tokens * 8 * dim * dim
        )
        macs += config.num_layers * per_block
        macs += 2 * dim * dim + n * dim * config.patch_size**2 * config.out_channels
        return float(2 * batch * macs)


def _mask_or_ones(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else mask


def _pad_text(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [P, l, D] embeds with zeros and [P, l] masks with 0 to `length` (as the pipeline pads)."""
    extra = length - embeds.shape[1]
    if extra == 0:
        return embeds, mask
    return F.pad(embeds, (0, 0, 0, extra)), F.pad(mask, (0, extra))
