"""HunyuanVideo-1.5 text-to-video (`HunyuanVideo15Pipeline`): the adapter and a tiny random builder.

What the diffusers pipeline does (diffusers 0.42), and therefore what this adapter does:

- Text, two encoders, both through `pipe.encode_prompt`:
  1. Qwen2.5-VL (the "MLLM"): each prompt in the chat template with the pipeline's system message
     (describe the video ...), padded to 1000 + 108 tokens, the hidden state 3 from the top kept,
     the first 108 positions (the system part of the template) cropped: [P, 1000, D_mllm] with a
     mask (1 = real token). `max_sequence_length` keeps the first L <= 1000 of those positions;
     the encoder is causal, so that equals encoding the truncated prompt. At L = 1000 (the presets'
     value) the transformer sees exactly the pipeline's text.
  2. ByT5 on the prompt's quoted text only ("..." / “...”, the glyph text rendered in the video):
     [P, 256, D_byt5] with a mask; all zeros with a zero mask when the prompt quotes nothing.
  `PromptEmbeds.embeds` holds both as one table [P, L + 256, D_mllm]: the MLLM tokens, then the
  ByT5 tokens zero-padded in width to D_mllm (`mask` likewise); `velocity` splits them again.
- Latents: [B, C, T', H/16, W/16] with C = the VAE's latent channels (32), T' = (T − 1)/4 + 1. The
  transformer takes [latents, condition latents, mask] on the channel axis (2C + 1 = 65): zeros
  for text-to-video, as `prepare_cond_latents_and_mask`; patch size 1, so every latent position is
  a token. The image-condition stream gets 729 zero SigLIP embeddings, which the transformer
  masks out (its text-to-video rule: all-zero image embeds).
- Network call: `timestep` = the scheduler's 1000·σ cast to the transformer's dtype (the pipeline's
  `t.expand(B).to(latent_model_input.dtype)`: bf16 rounds it); the output is the flow-matching
  velocity itself.
- CFG: the pipeline's `guider` component (`ClassifierFreeGuidance`) sets the scale, not a call
  argument: v = v_u + g·(v_c − v_u), on unless g == 1 (the guider's rule); the negative prompt
  defaults to "" (the pipeline encodes it when none is given). Here `guidance_scale` is diffrl's
  setting (the model card's 6.0 in the presets); the reference pipeline of `diffrl check` gets a
  guider with that scale. Both halves run as one forward of [positive, negative] rows. Guider
  settings beyond the scale (rescale, start/stop, the original formulation) are refused.
- Schedule: sigmas linspace(1, 0, N + 1)[:-1] with the checkpoint scheduler config's static
  shift (read from the model directory; the tiny model's is 5.0), the same float32 values as the
  "flux" convention's linspace(1, 1/N, N) for every N <= 1000 (checked); the pipeline passes no mu.
- Decode: latents / scaling_factor, `vae.decode` one video at a time (the diffusers 0.42 VAE
  fails on a batch of several: its causal attention mask does not broadcast; the pipeline itself
  decodes a batch only with `pipe.vae.enable_slicing()`), uint8 (the pipeline's postprocess
  rounding); videos [B, T, 3, H, W].

The tiny random builder is `hunyuan_video15_tiny`.

LoRA: `HunyuanVideo15Pipeline` has no LoRA loader in diffusers 0.42 (no `load_lora_weights`); an
export loads with the transformer's own `load_lora_adapter(DIR, prefix="transformer")`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8

#: What `HunyuanVideo15Pipeline.__init__` fixes: the MLLM's text length after the crop, the ByT5
#: text length, the image-condition tokens (SigLIP), the system-template prefix it crops.
MLLM_TOKENS = 1000
BYT5_TOKENS = 256
IMAGE_TOKENS = 729
TEMPLATE_PREFIX_TOKENS = 108
#: The ByT5 projection's hidden width (fixed in `HunyuanVideo15ByT5TextProjection`).
_BYT5_PROJ_WIDTH = 2048
#: The timestep embedding's sinusoid width (fixed in diffusers).
_T_FREQ = 256


class HunyuanVideo15Adapter(ModelAdapter):
    """HunyuanVideo-1.5: a dual-stream DiT (`HunyuanVideo15TransformerBlock`s over video tokens and
    the joined text tokens) on Qwen2.5-VL and ByT5 text features."""

    pipeline_class_name: ClassVar[str] = "HunyuanVideo15Pipeline"
    max_text_tokens: ClassVar[int] = MLLM_TOKENS
    schedule_convention: ClassVar[str] = "flux"
    latent_layout: ClassVar[str] = "the HunyuanVideo-1.5 latent layout"
    block_class_names: ClassVar[tuple[str, ...]] = ("HunyuanVideo15TransformerBlock",)
    # Both streams' attention projections and MLPs of every block (peft's suffix match also takes
    # the text refiner's attention and MLP).
    default_lora_target_modules: ClassVar[tuple[str, ...]] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    is_video: ClassVar[bool] = True

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        config = pipe.transformer.config
        if config.use_meanflow:
            raise ValueError(
                "this HunyuanVideo-1.5 transformer has use_meanflow set (the super-resolution model), "
                "which HunyuanVideo15Pipeline does not drive: load a text-to-video checkpoint"
            )
        if config.in_channels != 2 * config.out_channels + 1:
            raise ValueError(
                f"this transformer takes {config.in_channels} channels for {config.out_channels} latent "
                "channels; HunyuanVideo15Pipeline feeds 2·C + 1 (latents, condition latents, mask)"
            )
        d_mllm, d_byt5 = config.text_embed_dim, config.text_embed_2_dim
        if d_byt5 > d_mllm:
            raise ValueError(
                f"text_embed_2_dim={d_byt5} > text_embed_dim={d_mllm}: diffrl stores the ByT5 features "
                "zero-padded to the MLLM's width"
            )
        guider = pipe.guider
        cfg = guider.config
        if type(guider).__name__ != "ClassifierFreeGuidance" or (
            cfg.guidance_rescale,
            cfg.use_original_formulation,
            cfg.start,
            cfg.stop,
            cfg.enabled,
        ) != (0.0, False, 0.0, 1.0, True):
            raise ValueError(
                f"this pipeline's guider is {type(guider).__name__}({dict(cfg)}); diffrl drives "
                "ClassifierFreeGuidance with guidance_rescale 0, start 0, stop 1, the diffusers "
                "formulation (guider/config.json of the HunyuanVideo-1.5 checkpoints)"
            )

    @property
    def lora_file_class(self) -> type:
        """`HunyuanVideoLoraLoaderMixin`: HunyuanVideo15Pipeline has no LoRA mixin in diffusers
        0.42; this one writes the plain diffusers format (`transformer.`-prefixed peft keys, the
        LoraConfig as metadata) that `transformer.load_lora_adapter(DIR, prefix="transformer")` loads."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` for the prompts (and the negatives): the MLLM's first
        `max_sequence_length` positions then the ByT5 table, one [P, L + 256, D_mllm] tensor with
        int64 masks (module docstring)."""
        prompts = self._prompt_batch(prompts, negative_prompts, max_sequence_length, "HunyuanVideo-1.5")
        with torch.no_grad():
            embeds, mask = self._encode(prompts, max_sequence_length)
            fields = {}
            if negative_prompts is not None:
                fields["negative_embeds"], fields["negative_mask"] = self._encode(
                    list(negative_prompts), max_sequence_length
                )
        return PromptEmbeds(embeds=embeds, mask=mask, **fields, batch_size=[len(prompts)])

    def _encode(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        mllm, mllm_mask, byt5, byt5_mask = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, dtype=self.dtype, batch_size=len(prompts)
        )
        width = mllm.shape[-1]
        byt5 = torch.nn.functional.pad(byt5, (0, width - byt5.shape[-1]))
        embeds = torch.cat([mllm[:, :length], byt5], dim=1)
        mask = torch.cat([mllm_mask[:, :length], byt5_mask], dim=1).long()
        return embeds, mask

    def _split_text(self, embeds: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The transformer's four text inputs from one stored table, as the pipeline passes them
        (embeddings and masks in the network's dtype)."""
        d_byt5 = self.pipe.transformer.config.text_embed_2_dim
        cut = embeds.shape[1] - BYT5_TOKENS
        embeds = embeds.to(self.device, self.dtype)
        mask = mask.to(self.device, self.dtype)
        return dict(
            encoder_hidden_states=embeds[:, :cut],
            encoder_attention_mask=mask[:, :cut],
            encoder_hidden_states_2=embeds[:, cut:, :d_byt5],
            encoder_attention_mask_2=mask[:, cut:],
        )

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """The guider's rule: CFG runs unless guidance_scale == 1."""
        return not math.isclose(guidance_scale, 1.0)

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
        """The `HunyuanVideo15Pipeline` call of these settings, plus `guidance_scale`, which
        `pipeline_latents` hands to the reference pipeline's guider (the pipeline takes no such
        argument). The pipeline always reads 1000 MLLM tokens: the text is the same as ours at
        max_sequence_length=1000, or when every prompt fits in fewer."""
        self._require_no_true_cfg(true_cfg_scale)
        self._require_no_images(images)
        self._latent_dims(height, width, num_frames)
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale)
        return dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if cfg else None,
            guidance_scale=guidance_scale if cfg else 1.0,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            num_frames=num_frames,
        )

    def guided_pipeline(self, guidance_scale: float):
        """The loaded pipeline's modules with a guider of this scale (`guider.new`)."""
        pipe = type(self.pipe)(
            **{**self.pipe.components, "guider": self.pipe.guider.new(guidance_scale=guidance_scale)}
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_latents(self, latents: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
        call = dict(call)
        pipe = self.guided_pipeline(call.pop("guidance_scale"))
        return pipe(latents=latents, output_type="latent", **call).frames

    # ------------------------------------------------------------------------------ latents
    def _latent_dims(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        temporal = self.pipe.vae_scale_factor_temporal
        spatial = self.pipe.vae_scale_factor_spatial
        patch = self.pipe.transformer.config.patch_size
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames={num_frames}: HunyuanVideo-1.5 needs num_frames = {temporal}·k + 1 (e.g. 1, 33, "
                f"121), the VAE compresses time by {temporal} after the first frame"
            )
        multiple = spatial * patch
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"height={height}, width={width}: both must be positive multiples of {multiple} "
                f"(VAE factor {spatial} x patch {patch})"
            )
        return (num_frames - 1) // temporal + 1, height // spatial, width // spatial

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """[C, T', H/16, W/16]: the VAE latent (the transformer's patch is 1 on the real model)."""
        return (self.pipe.transformer.config.out_channels, *self._latent_dims(height, width, num_frames))

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        frames, h, w = self._latent_dims(height, width, num_frames)
        cfg = self.pipe.transformer.config
        return (frames // cfg.patch_size_t) * (h // cfg.patch_size) * (w // cfg.patch_size)

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
        """fp32 velocity [B, C, T', h, w] at model timesteps 1000·σ; with CFG (g != 1 and negatives)
        one forward of [positive, negative] rows combined as v_u + g·(v_c − v_u)."""
        self._require_no_true_cfg(true_cfg_scale)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        hidden = latents.to(self.device, self.dtype)
        # text-to-video: zero condition latents and mask on the channel axis
        b, c, *grid = hidden.shape
        hidden = torch.cat([hidden, hidden.new_zeros(b, c + 1, *grid)], dim=1)
        timestep = timestep_B.to(self.dtype)  # as the pipeline: in the network's dtype
        text = self._split_text(cond.embeds, cond.mask)
        # CFG as one batched call, then chunk and combine: the same block is in sd3.py, flux.py,
        # qwen_image.py, wan.py, zimage.py. Rows [positive, negative], the pipeline's order.
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale)
        if do_cfg:
            negative = self._split_text(cond.negative_embeds, cond.negative_mask)
            text = {k: torch.cat([v, negative[k]]) for k, v in text.items()}
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
        image_dim = self.pipe.transformer.config.image_embed_dim
        image_embeds = hidden.new_zeros(hidden.shape[0], IMAGE_TOKENS, image_dim)
        out = self.run_transformer(
            hidden_states=hidden, timestep=timestep, image_embeds=image_embeds, return_dict=False, **text
        )[0].float()
        if not do_cfg:
            return out
        v_cond, v_uncond = out.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """uint8 [B, T, 3, H, W], as the pipeline decodes its final latents."""
        expected = self.latent_shape(height, width, num_frames)
        if tuple(latents.shape[1:]) != expected:
            raise ValueError(
                f"decode got latents of shape {tuple(latents.shape)}, expected [B, *{expected}] for "
                f"{num_frames} frames of {height}x{width}"
            )
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
            # one video at a time (the VAE's `enable_slicing`): the diffusers 0.42 VAE's mid-block
            # attention broadcasts its causal mask [B, N, N] against [B, 1, N, N] and fails for B > 1
            video_BCTHW = torch.cat([vae.decode(z[i : i + 1], return_dict=False)[0] for i in range(len(z))])
        return to_uint8(video_BCTHW).permute(0, 2, 1, 3, 4).contiguous()

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of every linear and of attention (QK^T, AV) in one `HunyuanVideo15Transformer3DModel`
        forward over `batch` samples.

        `text_len` L is the MLLM text length (`max_sequence_length`). With S video tokens, D the
        width, C_in/C_out the channels, p the patch volume, per sample:
          embedders: patch S·C_in·p·D; time MLP 256·D + D²; the text refiner's time MLP and
            pooled-text MLP 256·D + D² + D_mllm·D + D², proj_in L·D_mllm·D; the ByT5 projection
            256·(D_byt5·2048 + 2048² + 2048·D); the image projection 729·(I² + I·D);
          text refiner block (on L tokens): q, k, v, out 4·L·D², attention 2·L²·D, MLP 8·L·D²
            (its width is 4·D whatever `mlp_ratio`: diffusers builds the refiner with its default),
            gates 2·D²;
          a main block, N = 729 + 256 + L text tokens joined with S video tokens: modulation 12·D²,
            q, k, v, out per stream 4·(S + N)·D², attention over S + N tokens 2·(S + N)²·D, MLPs
            2·(S + N)·D·F with F = mlp_ratio·D (every masked text position is computed on);
          output: modulation 2·D², projection S·D·C_out·p.
        RoPE, norms, gates and softmax are elementwise and not counted.
        """
        if cond_tokens:
            raise ValueError(
                "HunyuanVideo-1.5 text-to-video takes no condition images: cond_tokens must be 0"
            )
        cfg = self.pipe.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        p = cfg.patch_size_t * cfg.patch_size**2
        s = self.image_seq_len(height, width, num_frames)
        n_text = IMAGE_TOKENS + BYT5_TOKENS + text_len
        n = s + n_text
        mlp = int(d * cfg.mlp_ratio)
        img = cfg.image_embed_dim
        macs = s * cfg.in_channels * p * d + (_T_FREQ * d + d * d)
        macs += _T_FREQ * d + d * d + cfg.text_embed_dim * d + d * d + text_len * cfg.text_embed_dim * d
        macs += BYT5_TOKENS * (
            cfg.text_embed_2_dim * _BYT5_PROJ_WIDTH + _BYT5_PROJ_WIDTH**2 + _BYT5_PROJ_WIDTH * d
        )
        macs += IMAGE_TOKENS * (img * img + img * d)
        refiner = 4 * text_len * d * d + 2 * text_len * text_len * d + 8 * text_len * d * d + 2 * d * d
        macs += cfg.num_refiner_layers * refiner
        block = 12 * d * d + 4 * n * d * d + 2 * n * n * d + 2 * n * d * mlp
        macs += cfg.num_layers * block
        macs += 2 * d * d + s * d * cfg.out_channels * p
        return float(2 * batch * macs)


__all__ = ["HunyuanVideo15Adapter"]
