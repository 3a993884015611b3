"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): the MMDiT family with three text encoders.

What the pipeline does, and so what this adapter does through the pipeline's own parts:

- Text: `pipe.encode_prompt` runs CLIP-L and CLIP-G (both `CLIPTextModelWithProjection`; the
  penultimate hidden states are concatenated on the feature axis and zero-padded to T5's width)
  and T5-XXL (`max_sequence_length` tokens, padded to that length), then concatenates the two on
  the token axis: `embeds` [P, 77 + max_sequence_length, joint_attention_dim]. `pooled` [P, 768 +
  1280] is the two CLIP projections concatenated. No attention mask: padded tokens are attended to,
  as in the pipeline and in training. The negative side is the pipeline's own (default "").
- Latents: [B, 16, H/8, W/8], unpacked (the transformer patchifies inside). fp32 outside, the
  compute dtype inside the network.
- Timestep: the scheduler's timesteps, 1000·σ (`Schedule.timesteps`), passed as float, one per
  sample, exactly as the pipeline's denoising loop passes `t.expand(B)`.
- CFG: the pipeline's order, cat([uncond, cond]) in one forward; v = v_u + g·(v_c − v_u).
- Decode: latents / vae.scaling_factor + vae.shift_factor -> `vae.decode` -> uint8 (the
  pipeline's postprocess, rounding as diffusers does).

Pixel space: a pipeline saved without a VAE (model_index.json `"vae": [null, null]`, as the
shapes world's toy model) generates pixels directly: latents are images in [-1, 1] with the
transformer's `in_channels` (3), and decode is the identity followed by the usual uint8 rounding.
The pipeline class, transformer and text encoders are unchanged, so it runs the same code path.

Schedule convention "sd3": `scheduler.set_timesteps(N)` with the checkpoint's static shift (3.0).

LoRA targets are Flow-GRPO's SD3 recipe (scripts/train_sd3.py): the joint attention's image- and
context-stream projections, `attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,
to_add_out}`. PEFT matches them as name suffixes, so SD3.5's second image self-attention `attn2`
and the MLPs are not adapted (as in the recipe); pass `model.lora.target_modules` to change that.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.models.tiny import tiny_kl_vae

# CombinedTimestepTextProjEmbeddings embeds the timestep with a 256-channel sinusoid (fixed in diffusers).
_TIMESTEP_PROJ_CHANNELS = 256
# FeedForward(dim, mult=4): Linear(D, 4D) -> GELU -> Linear(4D, D).
_FF_MULT = 4
# The pipeline's check_inputs limit on T5 tokens.
_MAX_T5_TOKENS = 512


class SD3Adapter(ModelAdapter):
    pipeline_class_name = "StableDiffusion3Pipeline"
    max_text_tokens = _MAX_T5_TOKENS
    schedule_convention = "sd3"
    block_class_names = ("JointTransformerBlock",)
    default_lora_target_modules = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int = 256,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` for P prompts: embeds [P, 77 + max_sequence_length, D], pooled [P, D'].

        With `negative_prompts` (one per prompt; "" is SD3's usual unconditional prompt) the
        negative fields are filled and CFG can run; None leaves them empty (no CFG).
        """
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a non-empty sequence of strings; got {prompts!r}")
        if negative_prompts is not None:
            negative_prompts = list(negative_prompts)
            if len(negative_prompts) != len(prompts) or not all(isinstance(p, str) for p in negative_prompts):
                raise ValueError(
                    f"negative_prompts must be one string per prompt ({len(prompts)}); got {negative_prompts!r}"
                )
        if not 1 <= max_sequence_length <= _MAX_T5_TOKENS:
            raise ValueError(
                f"max_sequence_length must be in [1, {_MAX_T5_TOKENS}] (T5 tokens); got {max_sequence_length}"
            )
        with torch.no_grad():
            embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=negative_prompts is not None,
                negative_prompt=negative_prompts,
                max_sequence_length=max_sequence_length,
            )
        return PromptEmbeds(
            embeds=embeds,
            pooled=pooled,
            negative_embeds=negative_embeds,
            negative_pooled=negative_pooled,
            batch_size=[len(prompts)],
        )

    # ------------------------------------------------------------------------------ latents
    @property
    def pixel_space(self) -> bool:
        """True for a pipeline without a VAE: the transformer denoises pixels."""
        return getattr(self.pipe, "vae", None) is None

    @property
    def vae_scale_factor(self) -> int:
        # The pipeline reports 8 when it has no VAE; pixel space has no downsampling at all.
        return 1 if self.pixel_space else self.pipe.vae_scale_factor

    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        if num_frames != 1:
            raise ValueError(f"SD3 generates images: num_frames must be 1; got {num_frames}")
        factor = self.vae_scale_factor
        multiple = factor * self.transformer.config.patch_size
        if height < multiple or width < multiple or height % multiple or width % multiple:
            raise ValueError(
                f"SD3 needs height and width divisible by {multiple} (VAE factor "
                f"{factor} x patch {self.transformer.config.patch_size}); "
                f"got {height}x{width}"
            )
        return height // factor, width // factor

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """[16, H/8, W/8]: the VAE latent as the transformer takes it (no packing)."""
        h, w = self._latent_hw(height, width, num_frames)
        return (self.transformer.config.in_channels, h, w)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        h, w = self._latent_hw(height, width, num_frames)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

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
        """One step of the pipeline's denoising loop: the transformer call, then standard CFG."""
        self._require_no_true_cfg(true_cfg_scale)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)

        x = latents.to(self.device, self.dtype)
        embeds, pooled = cond.embeds, cond.pooled
        # CFG as one batched call ([negatives; prompts], then chunk and combine): the same block is
        # in flux.py, qwen_image.py, wan.py. The families differ in their inputs and combine rule
        # (here: standard CFG), so each adapter keeps its own copy.
        do_cfg = cond.has_negative and guidance_scale > 1
        if do_cfg:
            x = torch.cat([x, x])
            timestep_B = torch.cat([timestep_B, timestep_B])
            embeds = torch.cat([cond.negative_embeds, embeds])
            pooled = torch.cat([cond.negative_pooled, pooled])
        out = self.run_transformer(
            hidden_states=x,
            timestep=timestep_B,
            encoder_hidden_states=embeds.to(self.device, self.dtype),
            pooled_projections=pooled.to(self.device, self.dtype),
            joint_attention_kwargs=None,
            return_dict=False,
        )[0].float()
        if not do_cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """uint8 [B, 3, H, W], as the pipeline decodes its final latents."""
        if self.pixel_space:
            return to_uint8(latents)
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
            images = vae.decode(z, return_dict=False)[0]
        return to_uint8(images)

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 images [B, 3, H, W] -> fp32 latents, the inverse of `decode` (supervised training).

        With a VAE: a sample of the encoder's posterior (its mode without a generator), shifted and
        scaled as the SD3 training scripts do, `(z - shift_factor) * scaling_factor`.
        """
        if pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(
                f"encode takes uint8 images [B, 3, H, W]; got {pixels.dtype} {tuple(pixels.shape)}"
            )
        images = pixels.to(self.device, torch.float32) / 127.5 - 1.0
        if self.pixel_space:
            return images
        vae = self.pipe.vae
        with torch.no_grad():
            posterior = vae.encode(images.to(vae.dtype)).latent_dist
            z = posterior.mode() if generator is None else posterior.sample(generator)
        return ((z.float() - vae.config.shift_factor) * vae.config.scaling_factor).float()

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of one `SD3Transformer2DModel` forward over `batch` samples.

        `text_len` is the number of text tokens the transformer sees (`embeds.shape[1]`, i.e.
        77 + max_sequence_length). With N image tokens, T = text_len, D = inner dim, per sample:

        - patch embedding N·(C·p²)·D; context embedder T·J·D; timestep and pooled MLPs
          (256·D + D² + P·D + D²); final AdaLN D·2D and projection N·D·p²·C_out.
        - each `JointTransformerBlock`: AdaLN modulations D·6D (image; D·9D with SD3.5's dual
          attention) and D·6D (context; D·2D in the last block, `context_pre_only`); image-stream
          q/k/v/out and MLP (8D²) on N tokens; context-stream add_q/k/v, to_add_out and MLP on T
          tokens (the last block has no to_add_out and no context MLP); joint attention QKᵀ and AV
          over all N + T tokens, 2·(N + T)²·D; SD3.5's `attn2` (layers in `dual_attention_layers`):
          4·N·D² projections and 2·N²·D attention on image tokens only.

        Elementwise work (norms, activations, softmax, RoPE-free modulation) is not counted.
        """
        cfg = self.transformer.config
        n = self.image_seq_len(height, width, num_frames)
        t = text_len
        d = cfg.num_attention_heads * cfg.attention_head_dim
        p2 = cfg.patch_size**2
        out_channels = cfg.out_channels or cfg.in_channels
        ff = 2 * _FF_MULT * d * d  # two linears D -> 4D -> D per token

        macs = n * cfg.in_channels * p2 * d  # patch embedding (conv)
        macs += _TIMESTEP_PROJ_CHANNELS * d + d * d + cfg.pooled_projection_dim * d + d * d
        macs += t * cfg.joint_attention_dim * cfg.caption_projection_dim
        for i in range(cfg.num_layers):
            dual = i in cfg.dual_attention_layers
            pre_only = i == cfg.num_layers - 1
            macs += d * (9 if dual else 6) * d  # norm1 (image AdaLN)
            macs += d * (2 if pre_only else 6) * d  # norm1_context
            macs += 4 * n * d * d + n * ff  # to_q/k/v, to_out.0, ff
            macs += 3 * t * d * d + (
                0 if pre_only else t * d * d + t * ff
            )  # add_q/k/v, to_add_out, ff_context
            macs += 2 * (n + t) ** 2 * d  # joint attention: QK^T and AV
            if dual:
                macs += 4 * n * d * d + 2 * n * n * d  # attn2: image self-attention
        macs += d * 2 * d + n * d * p2 * out_channels  # norm_out, proj_out
        return 2.0 * batch * macs


# ---------------------------------------------------------------------------------- tiny model
def build_tiny(path: Path, seed: int = 0) -> Path:
    """A tiny random SD3.5-like pipeline at `path` (64x64 px by default; any multiple of 16 up to 256).

    Real classes with small configs: `SD3Transformer2DModel` (2 `JointTransformerBlock`s, dim 32,
    SD3.5's dual attention in the first block and RMS qk-norm, patch 2, 16 latent channels),
    `AutoencoderKL` with 4 blocks (factor 8) and SD3's scaling/shift factors and no quant convs,
    CLIP-L/CLIP-G `CLIPTextModelWithProjection` (hidden 16/32, different so that the concatenation
    order matters), a T5 v1.1-style `T5EncoderModel` (d_model 64 = joint_attention_dim), the
    tokenizers of `diffrl.models.tiny_text`, and SD3.5's scheduler config (flow-match Euler, shift 3).
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from diffrl.models.tiny_text import clip_tokenizer, t5_tokenizer, text_encoder_ids

    path = Path(path)
    clip_l_dim, clip_g_dim, t5_dim = 16, 32, 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = clip_tokenizer()
        tokenizer_2 = clip_tokenizer(pad_token="!")  # SD3's CLIP-G tokenizer pads with "!"
        tokenizer_3 = t5_tokenizer()

        def clip(tok, hidden: int, heads: int, act: str) -> CLIPTextModelWithProjection:
            config = CLIPTextConfig(
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                projection_dim=hidden,
                num_hidden_layers=2,
                num_attention_heads=heads,
                max_position_embeddings=tok.model_max_length,
                hidden_act=act,
                **text_encoder_ids(tok),
            )
            return CLIPTextModelWithProjection(config).eval()

        text_encoder = clip(tokenizer, clip_l_dim, 2, "quick_gelu")  # CLIP-L (OpenAI)
        text_encoder_2 = clip(tokenizer_2, clip_g_dim, 4, "gelu")  # CLIP-G (OpenCLIP bigG)
        t5_ids = text_encoder_ids(tokenizer_3)
        text_encoder_3 = T5EncoderModel(
            T5Config(
                d_model=t5_dim,
                d_kv=16,
                d_ff=2 * t5_dim,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=32,
                feed_forward_proj="gated-gelu",
                is_encoder_decoder=False,
                decoder_start_token_id=t5_ids["pad_token_id"],
                **t5_ids,
            )
        ).eval()
        transformer = SD3Transformer2DModel(
            sample_size=8,  # latent size -> the pipeline's default 64x64 px
            patch_size=2,
            in_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=t5_dim,
            caption_projection_dim=32,
            pooled_projection_dim=clip_l_dim + clip_g_dim,
            out_channels=16,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ).eval()
        vae = tiny_kl_vae(scaling_factor=1.5305, shift_factor=0.0609).eval()
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
        pipe.save_pretrained(path)
    return path


__all__ = ["SD3Adapter", "build_tiny"]
