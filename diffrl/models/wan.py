"""Wan2.x text-to-video (`WanPipeline`): UMT5 text encoder, `WanTransformer3DModel`, `AutoencoderKLWan`.

Everything goes through the pipeline's own components and helpers; this module only re-arranges
the pipeline's denoising loop into one differentiable `velocity` call.

Layout and conventions (what the sampler and trainer see):

- latents [B, C, T', H/s, W/s] (5-D, not packed), C = transformer `in_channels` (= VAE `z_dim`),
  T' = (num_frames − 1)//t + 1 with t = VAE `scale_factor_temporal` (4) and s =
  `scale_factor_spatial` (8 for Wan2.1; 16 for the Wan2.2 TI2V-5B VAE). The transformer patches
  them with `patch_size` (1, 2, 2), so the video tokens are (T'/1)·(H/s/2)·(W/s/2). The latents
  are in the pipeline's normalised space: `decode` maps z -> z·std + mean with the VAE config's
  `latents_std` / `latents_mean` exactly as `WanPipeline.__call__` does before `vae.decode`.
- model timestep = the schedule's timestep (1000·σ), passed as `timestep=[B]` like the pipeline's
  `t.expand(B)`; with the pipeline's `expand_timesteps` (Wan2.2 TI2V-5B) it is one timestep per
  video token, [B, T'·(H/s/2)·(W/s/2)], as the pipeline builds it.
- text: `pipe.encode_prompt` (the pipeline's prompt cleaning, UMT5 with the attention mask, then
  each prompt's embeddings zero-padded to `max_sequence_length`). The transformer cross-attends
  to all `max_sequence_length` positions, padding included, so no mask is kept.
- CFG (standard, v = v_u + g·(v_c − v_u)): the pipeline runs two forwards (cond, then uncond);
  here one forward of 2B on cat([uncond, cond]) — equal up to float rounding, since every op of
  the transformer is per-sample. The combination is done in fp32.
- sampling: Wan checkpoints ship a UniPC multistep scheduler (`use_flow_sigmas`, `flow_shift`);
  diffrl samples flow-match Euler with the same shift (`schedule_convention="wan"`, see
  `diffrl.schedules`). The tiny builder writes a `FlowMatchEulerDiscreteScheduler(shift=3.0)` so
  that `WanPipeline(...)` itself samples with the Euler steps diffrl takes.
- `decode` returns uint8 videos [B, T, 3, H, W] with T = (T' − 1)·t + 1. The VAE runs in fp32
  (the Wan examples load `AutoencoderKLWan` in fp32 whatever the transformer's dtype).

- Wan2.2 A14B's two experts (`transformer` for high noise, `transformer_2` for low noise, switched
  at t = `boundary_ratio` · `num_train_timesteps` as `WanPipeline.__call__` does): the adapter's
  `transformer` is the two as one module (`diffrl.models.experts.TimestepExperts`), so both are
  trained, LoRA spans both (one adapter, exported as one diffusers file per expert: the second is
  loaded with `load_lora_weights(..., load_into_transformer_2=True)`), and each step runs on the
  expert its timestep selects. One guidance scale serves both experts (the pipeline's default
  when `guidance_scale_2` is not given).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.models.experts import TimestepExperts

# The tiny pipeline's sizes (real Wan2.1-T2V-1.3B: 12 heads × 128, 30 layers, ffn 8960, text_dim
# 4096 from UMT5-XXL, VAE z_dim 16 with base_dim 96).
_TINY_Z_DIM = 4
_TINY_HEADS, _TINY_HEAD_DIM = 2, 16  # head_dim 16: rope splits it t/h/w = 8/4/4
_TINY_TEXT_DIM = 32
#: Wan2.1-T2V-1.3B's scheduler `flow_shift` (480p).
TINY_SHIFT = 3.0
#: Wan2.2-T2V-A14B's `boundary_ratio`: the high-noise expert denoises t >= 875 of 1000.
TINY_BOUNDARY_RATIO = 0.875


class WanAdapter(ModelAdapter):
    pipeline_class_name = "WanPipeline"
    # UMT5's text length in Wan: the pipeline pads every prompt to max_sequence_length (default 512)
    # and sets no limit of its own, so 1e9 would allocate 1e9 x 4096 values per prompt
    max_text_tokens = 512
    schedule_convention = "wan"
    block_class_names = ("WanTransformerBlock",)
    # Self-attention (attn1) and cross-attention (attn2) q/k/v/out of every block, and the block's
    # FFN (GELU-tanh up projection `ffn.net.0.proj`, down projection `ffn.net.2`).
    default_lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    is_video = True
    component_dtypes: ClassVar[dict[str, torch.dtype]] = {"vae": torch.float32}  # as the Wan examples

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        if getattr(pipe, "transformer", None) is None:
            raise ValueError("this WanPipeline directory has no `transformer`; diffrl needs one to sample")
        self._experts = self._two_experts(pipe)

    @staticmethod
    def _two_experts(pipe) -> TimestepExperts | None:
        """Wan2.2 A14B's experts as one module, or None for a one-transformer directory."""
        second, ratio = getattr(pipe, "transformer_2", None), pipe.config.boundary_ratio
        if second is None and ratio is None:
            return None
        if second is None or ratio is None:
            raise ValueError(
                f"this WanPipeline directory has transformer_2={'set' if second is not None else 'none'} and "
                f"boundary_ratio={ratio}: a two-expert Wan2.2 directory needs both (model_index.json)"
            )
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"boundary_ratio={ratio} in model_index.json: it must lie in (0, 1)")
        architecture = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
        if architecture(pipe.transformer.config) != architecture(second.config):
            raise ValueError(
                "transformer and transformer_2 of this Wan2.2 directory differ in architecture "
                "(their config.json files): the two experts must share one"
            )
        boundary = ratio * pipe.scheduler.config.num_train_timesteps  # WanPipeline's boundary_timestep
        return TimestepExperts([("transformer", pipe.transformer), ("transformer_2", second)], [boundary])

    @property
    def transformer(self) -> torch.nn.Module:
        """The one transformer, or Wan2.2 A14B's two experts as one module (`TimestepExperts`)."""
        return self._experts if self._experts is not None else self.pipe.transformer

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        prompts = list(prompts)
        cfg = negative_prompts is not None
        if cfg and len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: pass one per prompt"
            )
        with torch.no_grad():
            embeds, negative = self.pipe.encode_prompt(
                prompt=prompts,
                negative_prompt=list(negative_prompts) if cfg else None,
                do_classifier_free_guidance=cfg,
                num_videos_per_prompt=1,
                max_sequence_length=max_sequence_length,
                device=self.device,
                dtype=self.dtype,
            )
        return PromptEmbeds(embeds=embeds, negative_embeds=negative, batch_size=[len(prompts)])

    # ------------------------------------------------------------------------------ latents
    def _latent_dims(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        temporal = self.pipe.vae_scale_factor_temporal
        spatial = self.pipe.vae_scale_factor_spatial
        _, p_h, p_w = self.transformer.config.patch_size
        if num_frames < 1 or (num_frames - 1) % temporal != 0:
            raise ValueError(
                f"num_frames={num_frames}: Wan needs num_frames = {temporal}·k + 1 (e.g. 1, 5, 33, 81), "
                f"the VAE compresses time by {temporal} after the first frame"
            )
        if height % (spatial * p_h) or width % (spatial * p_w):
            raise ValueError(
                f"height={height}, width={width}: both must be multiples of {spatial * p_h} "
                f"(VAE factor {spatial} × patch {p_h})"
            )
        return (num_frames - 1) // temporal + 1, height // spatial, width // spatial

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        frames, h, w = self._latent_dims(height, width, num_frames)
        return (self.transformer.config.in_channels, frames, h, w)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        frames, h, w = self._latent_dims(height, width, num_frames)
        p_t, p_h, p_w = self.transformer.config.patch_size
        return (frames // p_t) * (h // p_h) * (w // p_w)

    # ------------------------------------------------------------------------------ network
    def _model_timestep(self, timestep_B: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The `timestep` argument as `WanPipeline.__call__` builds it for one step."""
        timestep_B = timestep_B.to(device=self.device, dtype=torch.float32)
        if not self.pipe.config.expand_timesteps:
            return timestep_B
        # Wan2.2 TI2V: one timestep per token, from the pipeline's all-ones (text-to-video) mask.
        mask = torch.ones(latents.shape[2:], dtype=torch.float32, device=self.device)
        return (mask[:, ::2, ::2].flatten()[None, :] * timestep_B[:, None]).contiguous()

    def reference_pipeline(self):
        """`WanPipeline` on the same modules, sampling with flow-match Euler at the checkpoint's
        shift, as diffrl does (`diffrl.schedules`, "wan"): the diffusers Wan checkpoints ship a
        multistep UniPC solver, which has no single Gaussian transition per step."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from diffrl.schedules import euler_config

        if isinstance(self.pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            return self.pipe
        euler = FlowMatchEulerDiscreteScheduler.from_config(euler_config(self.scheduler_config, "wan"))
        pipe = type(self.pipe)(**{**self.pipe.components, "scheduler": euler})
        pipe.set_progress_bar_config(disable=True)
        return pipe

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
        self._require_no_true_cfg(true_cfg_scale)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        hidden = latents.to(self.device, self.dtype)
        timestep = self._model_timestep(timestep_B, latents)
        embeds = cond.embeds.to(self.device, self.dtype)
        # CFG as one batched call ([negatives; prompts], then chunk and combine): the same block is
        # in sd3.py, flux.py, qwen_image.py. The families differ in their inputs and combine rule
        # (here: standard CFG), so each adapter keeps its own copy.
        cfg = cond.has_negative and self.wants_negative(guidance_scale)
        if cfg:
            negative = cond.negative_embeds.to(self.device, self.dtype)
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([negative, embeds])
        out = self.run_transformer(
            hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
        )[0].float()
        if not cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        vae = self.pipe.vae
        expected = self.latent_shape(height, width, num_frames)
        if tuple(latents.shape[1:]) != expected:
            raise ValueError(
                f"decode got latents of shape {tuple(latents.shape)}, expected [B, *{expected}] for "
                f"{num_frames} frames of {height}x{width}"
            )
        with torch.no_grad():
            z = latents.to(vae.device, vae.dtype)
            # WanPipeline.__call__'s de-normalisation, verbatim in effect.
            latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
            latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
            z = z / latents_std.to(z.device, z.dtype) + latents_mean.to(z.device, z.dtype)
            video_BCTHW = vae.decode(z, return_dict=False)[0]
        return to_uint8(video_BCTHW).permute(0, 2, 1, 3, 4).contiguous()

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of one `WanTransformer3DModel` forward over `batch` samples.

        `text_len` is the cross-attended text length, i.e. `max_sequence_length` (the pipeline pads
        every prompt to it and the transformer attends to all of it). With S video tokens, L text
        tokens, width D, FFN width F, per sample:

        - patch embedding (Conv3d): 2·S·(C·p)·D, p = prod(patch_size); output projection 2·S·D·(C·p)
        - condition embedder: text projection 2·L·(D_text·D + D²); time MLP and its 6-way
          modulation projection 2·(f·D + D² + 6D²), per token when timesteps are per token
        - per block: self-attention q/k/v/o 8·S·D² + scores and values 4·S²·D; cross-attention
          q/o 4·S·D², k/v over text 4·L·D², scores and values 4·S·L·D; FFN 4·S·D·F
        """
        cfg = self.transformer.config
        seq = self.image_seq_len(height, width, num_frames)
        dim = cfg.num_attention_heads * cfg.attention_head_dim
        patch = math.prod(cfg.patch_size)
        out_channels = cfg.out_channels or cfg.in_channels
        time_tokens = seq if self.pipe.config.expand_timesteps else 1
        embed = 2 * seq * cfg.in_channels * patch * dim + 2 * seq * dim * out_channels * patch
        embed += 2 * text_len * (cfg.text_dim * dim + dim * dim)
        embed += 2 * time_tokens * (cfg.freq_dim * dim + dim * dim + 6 * dim * dim)
        self_attn = 8 * seq * dim * dim + 4 * seq * seq * dim
        cross_attn = 4 * seq * dim * dim + 4 * text_len * dim * dim + 4 * seq * text_len * dim
        ffn = 4 * seq * dim * cfg.ffn_dim
        return float(batch * (embed + cfg.num_layers * (self_attn + cross_attn + ffn)))


def _tiny_transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=_TINY_HEADS,
        attention_head_dim=_TINY_HEAD_DIM,
        in_channels=_TINY_Z_DIM,
        out_channels=_TINY_Z_DIM,
        text_dim=_TINY_TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    ).eval()


def build_tiny(path: Path, seed: int = 0, *, two_experts: bool = False) -> Path:
    """Write a tiny random Wan2.1-style text-to-video pipeline to `path` (about 1.2 MB).

    Real classes at small sizes: a 2-block `WanTransformer3DModel` (2 heads × 16), an
    `AutoencoderKLWan` with Wan2.1's compression (×4 time, ×8 space; `z_dim` 4 with its own
    latents_mean/std), a 2-layer `UMT5EncoderModel` and the offline T5 tokenizer of
    `diffrl.models.tiny_text`. The scheduler is `FlowMatchEulerDiscreteScheduler(shift=3.0)`:
    the real checkpoints' UniPC `flow_shift` sampled as Euler, which is what diffrl does with a
    UniPC config too, so the pipeline and diffrl sample the same steps.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from diffrl.models.tiny_text import t5_tokenizer, text_encoder_ids

    path = Path(path)
    tokenizer = t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                **text_encoder_ids(tokenizer),
                d_model=_TINY_TEXT_DIM,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=32,
                feed_forward_proj="gated-gelu",
                dropout_rate=0.0,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        ).eval()
        transformer = _tiny_transformer()
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=_TINY_Z_DIM,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            # Non-trivial statistics so that a missing (de)normalisation shows in the tests.
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
            latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
            scale_factor_temporal=4,
            scale_factor_spatial=8,
        ).eval()
        # Wan2.2 A14B's low-noise expert: the same architecture, its own weights
        transformer_2 = _tiny_transformer() if two_experts else None
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=TINY_SHIFT)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=TINY_BOUNDARY_RATIO if two_experts else None,
    )
    pipe.save_pretrained(path)
    return path


def build_tiny_a14b(path: Path, seed: int = 0) -> Path:
    """`build_tiny` with Wan2.2 A14B's layout: a second, independently initialised transformer
    (`transformer_2`, the low-noise expert) and `boundary_ratio` 0.875 (the T2V-A14B's) in
    model_index.json."""
    return build_tiny(path, seed, two_experts=True)
