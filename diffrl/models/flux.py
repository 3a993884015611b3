"""FLUX.1 (`FluxPipeline`): the adapter and a tiny random builder.

Layout. FLUX's transformer sees packed latents: the VAE latent [B, C, h, w] (C = 16 for FLUX.1,
h = H/8, w = W/8) is cut into 2x2 patches and packed by the pipeline's `_pack_latents` into
tokens [B, (h/2)·(w/2), 4·C] = [B, (H/16)·(W/16), 64]. Everything this adapter takes and returns
(`init_noise`, `velocity`, the trajectory) is in that packed layout; `decode` unpacks with the
pipeline's `_unpack_latents`. Image position ids come from `_prepare_latent_image_ids`, text ids
are zeros [L, 3] as `encode_prompt` makes them.

Timesteps. The adapter takes the schedule's model timesteps t = 1000·σ (`Schedule.timesteps`) and,
like the pipeline's loop, calls the transformer with `timestep = t / 1000` (the transformer
multiplies by 1000 again inside). The schedule is the "flux" convention: explicit sigmas
linspace(1, 1/N, N) with the dynamic shift mu computed from image_seq_len = the packed token count.

Guidance. FLUX.1-dev is guidance-distilled: `guidance_scale` is not CFG but a number fed to the
transformer's guidance embedding (when `transformer.config.guidance_embeds`; FLUX.1-schnell has
none and ignores it), exactly the pipeline's `guidance_scale`. Real CFG with a negative prompt is
the pipeline's optional "true CFG" (`true_cfg_scale` > 1 with `negative_prompt`), which the
pipeline runs as a second transformer call per step; here it is `velocity(..., true_cfg_scale=s)`
with `cond.has_negative`, computed as ONE batched forward over [uncond, cond] (the guidance
embedding gets `guidance_scale` on both halves, as in the pipeline) and combined as
v = v_u + s·(v_c − v_u). Mapping to the pipeline call:

    velocity(guidance_scale=g, true_cfg_scale=s) with negatives
        == FluxPipeline(guidance_scale=g, true_cfg_scale=s, negative_prompt=...)
    velocity(guidance_scale=g) (no negatives, or s <= 1)
        == FluxPipeline(guidance_scale=g)                       (one pass, as the pipeline)

The Flow-GRPO / DanceGRPO FLUX recipes sample FLUX.1-dev with guidance_scale 3.5 and no negatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.models.tiny import tiny_kl_vae

# FLUX.1-dev's scheduler/scheduler_config.json (FLUX.1-schnell: no dynamic shift, shift 1.0).
FLUX_DEV_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


class FluxAdapter(ModelAdapter):
    """FLUX.1 through diffusers' `FluxPipeline` (CLIP-L pooled + T5 text, packed 2x2 latents)."""

    pipeline_class_name: ClassVar[str] = "FluxPipeline"
    max_text_tokens: ClassVar[int] = 512  # T5: the pipeline check_inputs limit
    schedule_convention: ClassVar[str] = "flux"
    latent_layout: ClassVar[str] = "the packed FLUX layout"
    block_class_names: ClassVar[tuple[str, ...]] = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    # torch's default attention (cuDNN on H100/H200) failed FLUX's training backward: an illegal
    # memory access at FLUX.1-dev's size, a NaN gradient on the tiny model (docs/performance.md)
    gpu_training_attn_backend: ClassVar[str | None] = "_native_flash"
    # Flow-GRPO's FLUX LoRA targets (scripts/train_flux.py). peft matches by name suffix, so the
    # attn.to_q/k/v entries also adapt the single-stream blocks' attention projections; the
    # single-stream proj_mlp / proj_out stay frozen, as in the recipe.
    default_lora_target_modules: ClassVar[tuple[str, ...]] = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt`: T5 embeds [P, max_sequence_length, D] (padded to the max length,
        no mask: FLUX attends to the pad tokens too) and the CLIP pooled vector [P, 768]."""
        prompts = _as_list(prompts, "prompts")
        if not 1 <= max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512] for FLUX; got {max_sequence_length}")
        with torch.no_grad():
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, max_sequence_length=max_sequence_length
            )
            fields = {}
            if negative_prompts is not None:
                negative_prompts = _as_list(negative_prompts, "negative_prompts")
                if len(negative_prompts) != len(prompts):
                    raise ValueError(
                        f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: "
                        "pass one negative per prompt"
                    )
                neg_embeds, neg_pooled, _ = self.pipe.encode_prompt(
                    prompt=negative_prompts, device=self.device, max_sequence_length=max_sequence_length
                )
                fields = {"negative_embeds": neg_embeds, "negative_pooled": neg_pooled}
        return PromptEmbeds(embeds=embeds, pooled=pooled, **fields, batch_size=[len(prompts)])

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Only true CFG needs negatives: FLUX's `guidance_scale` is the distilled guidance embedding."""
        return true_cfg_scale is not None and true_cfg_scale > 1

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
        """The `FluxPipeline` call of these settings (module docstring): `guidance_scale` is the
        distilled guidance embedding, true CFG runs with our negatives (the pipeline's default
        `true_cfg_scale` of 1 is off). FLUX.1 Kontext adds its condition images."""
        self._latent_hw(height, width, num_frames)  # num_frames must be 1
        self._require_no_images(images)
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale, true_cfg_scale)
        return dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if cfg else None,
            true_cfg_scale=true_cfg_scale if cfg else 1.0,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )

    # ------------------------------------------------------------------------------ latents
    @property
    def pixel_space(self) -> bool:
        """True for a pipeline without a VAE (the shapes edit task's toy model): the transformer
        denoises pixels in [-1, 1], packed 2x2 like latents (3 channels -> 12 per token)."""
        return getattr(self.pipe, "vae", None) is None

    @property
    def vae_scale_factor(self) -> int:
        # The pipeline reports 8 when it has no VAE; pixel space has no downsampling at all.
        return 1 if self.pixel_space else self.pipe.vae_scale_factor

    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """VAE latent (h, w) as the pipeline computes it; sizes it would silently resize are errors."""
        if num_frames != 1:
            raise ValueError(f"FLUX generates images: num_frames must be 1; got {num_frames}")
        factor = self.vae_scale_factor
        multiple = factor * 2
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"FLUX needs height and width that are positive multiples of {multiple} "
                f"(VAE factor {factor} x 2x2 packing); got {height}x{width}"
            )
        return 2 * (height // multiple), 2 * (width // multiple)

    def pack(self, pixels_or_latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> packed tokens [B, (h/2)·(w/2), 4·C] (the pipeline's `_pack_latents`)."""
        batch, channels, rows, cols = pixels_or_latents.shape
        return self.pipe._pack_latents(pixels_or_latents, batch, channels, rows, cols)

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Packed: ((H/16)·(W/16), 4·C) = (image_seq_len, transformer in_channels)."""
        return (self.image_seq_len(height, width, num_frames), self.transformer.config.in_channels)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        h, w = self._latent_hw(height, width, num_frames)
        return (h // 2) * (w // 2)

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
        """fp32 velocity [B, N, 64] for packed fp32 latents [B, N, 64] at model timesteps 1000·σ.

        `guidance_scale` is the distilled guidance embedding value (the pipeline's `guidance_scale`);
        with `cond.has_negative` and `true_cfg_scale` > 1 the unconditional and conditional halves
        run as one forward of 2B and combine as v_u + s·(v_c − v_u) in fp32 (the pipeline's true CFG,
        which it runs as two calls). Otherwise one conditional pass (v_u + 1·(v_c − v_u) = v_c).
        """
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        # CFG as one batched call ([negatives; prompts], then chunk and combine): the same block is in
        # sd3.py, qwen_image.py, wan.py. The families differ in their inputs and combine rule (here:
        # true CFG; guidance_scale is the distilled guidance embedding), so each keeps its own copy.
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale, true_cfg_scale)

        hidden = latents.to(self.device, self.dtype)
        # As the pipeline: t.expand(B).to(latents.dtype), then passed as timestep / 1000.
        timestep = timestep_B.to(self.device, self.dtype)
        embeds, pooled = cond.embeds, cond.pooled
        if do_cfg:
            if cond.negative_embeds.shape != cond.embeds.shape:
                raise ValueError(
                    f"negative_embeds {tuple(cond.negative_embeds.shape)} and embeds "
                    f"{tuple(cond.embeds.shape)} must have the same shape for the batched CFG forward "
                    "(encode both with the same max_sequence_length)"
                )
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond.negative_embeds, embeds])
            pooled = torch.cat([cond.negative_pooled, pooled])
        rows = hidden.shape[0]

        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=self.device, dtype=torch.float32).expand(rows)
        h, w = self._latent_hw(height, width, num_frames)
        img_ids = self.pipe._prepare_latent_image_ids(rows, h // 2, w // 2, self.device, self.dtype)
        # encode_prompt's text ids: zeros [L, 3] (all text tokens share position 0).
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        tokens = hidden.shape[1]
        hidden, img_ids = self._with_condition(hidden, img_ids, cond, do_cfg)

        out = self.run_transformer(
            hidden_states=hidden,
            timestep=timestep / 1000,
            guidance=guidance,
            pooled_projections=pooled.to(self.device, self.dtype),
            encoder_hidden_states=embeds.to(self.device, self.dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0][:, :tokens].float()
        if not do_cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + true_cfg_scale * (v_cond - v_uncond)

    def _with_condition(
        self, hidden: torch.Tensor, img_ids: torch.Tensor, cond: PromptEmbeds, cfg: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens and their position ids: the noisy latents only (FLUX.1
        text-to-image). FLUX.1 Kontext appends its condition tokens here; the velocity is read off
        the first `image_seq_len` output tokens either way."""
        return hidden, img_ids

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed latents -> uint8 [B, 3, H, W]: unpack, undo scaling/shift, VAE decode (as the
        pipeline); in pixel space unpack and round."""
        self._latent_hw(height, width, num_frames)
        with torch.no_grad():
            latents = self.pipe._unpack_latents(latents.float(), height, width, self.vae_scale_factor)
            if self.pixel_space:
                return to_uint8(latents)
            vae = self.pipe.vae
            latents = latents / vae.config.scaling_factor + vae.config.shift_factor
            images = vae.decode(latents.to(self.device, vae.dtype), return_dict=False)[0]
        return to_uint8(images)

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 images [B, 3, H, W] -> fp32 packed latents, the inverse of `decode` (supervised
        training): the VAE posterior's mode (a sample with a generator), `(z - shift_factor) ·
        scaling_factor` as the FLUX training scripts, packed 2x2; in pixel space the pixels in
        [-1, 1], packed."""
        if pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(
                f"encode takes uint8 images [B, 3, H, W]; got {pixels.dtype} {tuple(pixels.shape)}"
            )
        self._latent_hw(int(pixels.shape[2]), int(pixels.shape[3]), 1)
        images = pixels.to(self.device, torch.float32) / 127.5 - 1.0
        if self.pixel_space:
            return self.pack(images)
        vae = self.pipe.vae
        with torch.no_grad():
            posterior = vae.encode(images.to(vae.dtype)).latent_dist
            z = posterior.mode() if generator is None else posterior.sample(generator)
        return self.pack((z.float() - vae.config.shift_factor) * vae.config.scaling_factor).float()

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of every linear and of attention (QK^T, AV) in one `FluxTransformer2DModel` forward.

        D = heads·head_dim, N_i image tokens (the noisy latents' plus `cond_tokens` condition-image
        tokens: FLUX.1 Kontext runs them through every image-stream weight and proj_out as well), N_t
        text tokens, N = N_i + N_t. Per sample:
          double-stream block: each stream's weights on its own tokens (q,k,v,out 4D², MLP 8D²
            per token) -> 12·(N_i + N_t)·D², joint attention 2·N²·D, AdaLN 2 x D·6D;
          single-stream block: all N tokens through q,k,v (3D²), proj_mlp (4D²) and the fused
            proj_out (attn ⊕ MLP -> D: 5D²) -> 12·N·D², attention 2·N²·D, AdaLN D·3D;
          embedders: x_embedder N_i·C_in·D, context_embedder N_t·D_text·D, timestep (+ guidance)
            and pooled-text MLPs, norm_out D·2D, proj_out N_i·D·C_out.
        RoPE, norms, activations and softmax are elementwise and not counted.
        """
        cfg = self.transformer.config
        dim = cfg.num_attention_heads * cfg.attention_head_dim
        n_img = self.image_seq_len(height, width, num_frames) + cond_tokens
        n_txt = text_len
        n_all = n_img + n_txt
        out_channels = cfg.patch_size**2 * (cfg.out_channels or cfg.in_channels)

        embed_macs = n_img * cfg.in_channels * dim + n_txt * cfg.joint_attention_dim * dim
        embed_macs += (256 * dim + dim * dim) * (2 if cfg.guidance_embeds else 1)  # timestep (+ guidance) MLP
        embed_macs += cfg.pooled_projection_dim * dim + dim * dim  # pooled text MLP
        embed_macs += dim * 2 * dim + n_img * dim * out_channels  # norm_out modulation, proj_out

        attention_macs = 2 * n_all * n_all * dim  # QK^T and AV over all heads
        double_macs = 2 * dim * 6 * dim + 12 * (n_img + n_txt) * dim * dim + attention_macs
        single_macs = dim * 3 * dim + 12 * n_all * dim * dim + attention_macs

        macs = embed_macs + cfg.num_layers * double_macs + cfg.num_single_layers * single_macs
        return float(2 * batch * macs)


def _as_list(prompts: Sequence[str], name: str) -> list[str]:
    if isinstance(prompts, str):
        raise ValueError(f"{name} must be a sequence of strings, not one string: wrap it as [{prompts!r}]")
    return list(prompts)


# ---------------------------------------------------------------------------------- tiny builder
def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random FLUX.1-dev-shaped pipeline (guidance-distilled) to `path` (`tiny_pipeline`)."""
    path = Path(path)
    tiny_pipeline(seed).save_pretrained(path)
    return path


def tiny_pipeline(seed: int = 0, pipeline_class_name: str = "FluxPipeline"):
    """A tiny random FLUX.1-dev-shaped pipeline (guidance-distilled) of `pipeline_class_name`
    (FluxPipeline, or FluxKontextPipeline: the same components).

    Real classes at small sizes: `FluxTransformer2DModel` (2 double + 2 single blocks, D = 32,
    guidance embedding on, 16 latent channels -> 64 packed), `AutoencoderKL` with FLUX's 16 latent
    channels, scaling/shift factors and an 8x downsampling (4 blocks), CLIP-L-like `CLIPTextModel`
    and `T5EncoderModel` text encoders with tokenizers built locally, and FLUX.1-dev's scheduler
    config. 32x32 images give 4 image tokens, 64x64 give 16.
    """
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffrl.models import tiny_text

    clip_tok = tiny_text.clip_tokenizer()
    t5_tok = tiny_text.t5_tokenizer()
    text_dim, t5_dim = 32, 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=text_dim,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=clip_tok.model_max_length,
                projection_dim=text_dim,
                **tiny_text.text_encoder_ids(clip_tok),
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                d_model=t5_dim,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",  # T5 v1.1, as FLUX's T5-XXL
                decoder_start_token_id=t5_tok.pad_token_id,
                **tiny_text.text_encoder_ids(t5_tok),
            )
        )
        vae = tiny_kl_vae(scaling_factor=0.3611, shift_factor=0.1159)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=t5_dim,
            pooled_projection_dim=text_dim,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    return getattr(diffusers, pipeline_class_name)(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=t5_tok,
        transformer=transformer.eval(),
    )
