"""FLUX.2 [klein] (`Flux2KleinPipeline`): the adapter and tiny random builders.

What the diffusers pipeline does (diffusers 0.42), and therefore what this adapter does:

- Text: each prompt goes through the tokenizer's chat template (one user message, generation
  prompt, `enable_thinking=False`), is padded to `max_sequence_length`, and the Qwen3 text
  encoder's hidden states of layers (9, 18, 27) are stacked on the feature axis: embeds
  [P, max_sequence_length, 3·D_text], no mask (the transformer attends to the padding too, as in
  the pipeline). Text position ids are (0, 0, 0, l) for token l (`_prepare_text_ids`).
- Latents: the FLUX.2 VAE's 32 channels, patchified 2x2 (`_patchify_latents`) and normalised
  with the VAE's batch-norm running statistics, packed into tokens: fp32 [B, (H/16)·(W/16), 128].
  That is the space the pipeline's loop steps in, so it is the trajectory's layout here.
  `init_noise` draws [1, 128, H/16, W/16] per generator and packs it, as `prepare_latents`;
  image position ids are (0, row, column, 0) (`_prepare_latent_ids`).
- Network call: `transformer(hidden_states, timestep=t/1000, guidance=None,
  encoder_hidden_states, txt_ids, img_ids)` with t the scheduler's timestep 1000·σ cast to the
  compute dtype first, as the pipeline.
- CFG, as the model cards use it: the step-distilled [klein] checkpoints (FLUX.2-klein-4B/9B,
  model_index `is_distilled: true`) sample 4 steps without CFG (guidance_scale 1; the pipeline
  ignores a larger one, which diffrl refuses instead of ignoring); the base checkpoints
  (FLUX.2-klein-base-*) use classic CFG v = v_u + g·(v_c − v_u) for g > 1 (4.0 in the pipeline's
  example, 50 steps). The pipeline's negative prompt is always "" (it takes no negative prompt
  text, only embeddings): diffrl encodes `rollout.pipeline.negative_prompt` with the pipeline's
  own encoder and hands the pipeline those embeddings. Both CFG halves run as ONE forward of
  [negative, positive] (the pipeline runs two), combined in fp32.
- Schedule: explicit sigmas linspace(1, 1/N, N) and the pipeline's own `compute_empirical_mu`
  (a function of the image token count and of N, not FLUX.1's `calculate_shift`), applied by the
  scheduler (exponential time shift with the checkpoints' dynamic shifting).
- Decode: unpack, undo the batch-norm normalisation, unpatchify, `vae.decode`, uint8.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.schedules import Schedule, euler_config

#: The dynamic-shift Euler config of the FLUX.2 checkpoints' scheduler folder (the FLUX.1-dev
#: keys; the pipeline's `compute_empirical_mu` replaces the linear mu of those bounds).
FLUX2_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
#: Qwen3 hidden layers the pipeline stacks into the text embedding (`text_encoder_out_layers`).
TEXT_LAYERS = (9, 18, 27)


class Flux2KleinAdapter(ModelAdapter):
    """FLUX.2 [klein] 4B / 9B, distilled or base, through `Flux2KleinPipeline` (Qwen3 text, packed
    2x2-patchified 32-channel latents, double- then single-stream blocks)."""

    pipeline_class_name: ClassVar[str] = "Flux2KleinPipeline"
    #: How error messages name the family (FLUX.2 [dev], `flux2_dev`, shares this adapter's code).
    family_name: ClassVar[str] = "FLUX.2 [klein]"
    max_text_tokens: ClassVar[int] = 512  # the pipeline's tokenizer_max_length
    schedule_convention: ClassVar[str] = "flux"  # linear sigmas; mu is FLUX.2's own (`schedule`)
    latent_layout: ClassVar[str] = "the packed FLUX.2 layout"
    block_class_names: ClassVar[tuple[str, ...]] = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
    # Every linear of both block kinds: the double-stream blocks' attention projections and MLPs
    # (each stream's), the single-stream blocks' fused qkv+MLP input projection. The single-stream
    # fused output projection (`attn.to_out`, a Linear there) shares its name with the
    # double-stream blocks' `attn.to_out` ModuleList, which peft cannot adapt, so it stays frozen.
    default_lora_target_modules: ClassVar[tuple[str, ...]] = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        self._check_transformer(pipe)

    def _check_transformer(self, pipe) -> None:
        """Refuse a transformer this family's pipeline does not drive."""
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(
                "this FLUX.2 transformer has guidance_embeds=True (FLUX.2 [dev], guidance-distilled), which "
                "Flux2KleinPipeline does not drive (it passes no guidance): load a FLUX.2 [klein] checkpoint"
            )

    @property
    def distilled(self) -> bool:
        """Step-distilled (FLUX.2-klein-4B/9B): sampled without CFG."""
        return bool(self.pipe.config.get("is_distilled", False))

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt`: embeds [P, max_sequence_length, 3·D_text] for both sides."""
        prompts = self._prompt_batch(prompts, negative_prompts, max_sequence_length, self.family_name)
        with torch.no_grad():
            embeds = self._encode(prompts, max_sequence_length)
            fields = {}
            if negative_prompts is not None:
                fields["negative_embeds"] = self._encode(list(negative_prompts), max_sequence_length)
        return PromptEmbeds(embeds=embeds, **fields, batch_size=[len(prompts)])

    def _encode(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=max_sequence_length
        )
        return embeds

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Classic CFG for g > 1 on a base checkpoint; a distilled one refuses g > 1 (it has no CFG)."""
        if guidance_scale > 1 and self.distilled:
            raise ValueError(
                f"guidance_scale={guidance_scale}: this FLUX.2 [klein] checkpoint is step-distilled "
                "(model_index.json is_distilled=true) and samples without CFG; its pipeline would ignore "
                "the value. Set rollout.pipeline.guidance_scale=1.0 (its model card's, with 4 steps), or "
                "use a klein-base checkpoint for CFG"
            )
        return guidance_scale > 1

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
        """The `Flux2KleinPipeline` call of these settings; the negatives go in as the pipeline's
        own encodings of them (`negative_prompt_embeds`: the pipeline takes no negative text)."""
        self._require_no_true_cfg(true_cfg_scale)
        self._require_no_images(images)
        self._latent_hw(height, width, num_frames)
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale)
        call: dict[str, Any] = dict(
            prompt=list(prompts),
            guidance_scale=guidance_scale if cfg else 1.0,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )
        if cfg:
            with torch.no_grad():
                call["negative_prompt_embeds"] = self._encode(list(negative_prompts), max_sequence_length)
        return call

    def pipeline_latents(self, latents: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
        """The pipeline's latents after its last step, in the packed normalised space it steps in
        (its `output_type="latent"` returns them unpacked, de-normalised and unpatchified: a layout
        of its own), read with its step-end callback; `latents` are handed over unpacked, as it
        takes them."""
        final: list[torch.Tensor] = []

        def keep(pipe, step, timestep, tensors):
            final[:] = [tensors["latents"]]
            return {}

        batch, _, channels = latents.shape
        h, w = self._latent_hw(call["height"], call["width"], 1)
        unpacked = latents.permute(0, 2, 1).reshape(batch, channels, h // 2, w // 2)
        self.reference_pipeline()(latents=unpacked, output_type="latent", callback_on_step_end=keep, **call)
        return final[0]

    # ------------------------------------------------------------------------------ latents
    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """VAE latent (h, w) = (H/8, W/8); H and W must be multiples of 16 (8 x the 2x2 patches)."""
        if num_frames != 1:
            raise ValueError(f"{self.family_name} generates images: num_frames must be 1; got {num_frames}")
        factor = self.pipe.vae_scale_factor
        multiple = factor * 2
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            # the pipeline would resize silently (a warning); diffrl refuses
            raise ValueError(
                f"{self.family_name} needs height and width that are positive multiples of {multiple} "
                f"(VAE factor {factor} x 2x2 patches); got {height}x{width}"
            )
        return height // factor, width // factor

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Packed: ((H/16)·(W/16), 128) = (image tokens, transformer in_channels)."""
        return (self.image_seq_len(height, width, num_frames), self.transformer.config.in_channels)

    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        h, w = self._latent_hw(height, width, num_frames)
        return (h // 2) * (w // 2)

    def init_noise(
        self, generators: Sequence[torch.Generator], height: int, width: int, num_frames: int = 1
    ) -> torch.Tensor:
        """fp32 packed noise, one [1, 128, H/16, W/16] draw per generator then packed, as
        `prepare_latents` draws it (the same noise `pipe(generator=[...])` starts from in fp32)."""
        h, w = self._latent_hw(height, width, num_frames)
        shape = (1, self.transformer.config.in_channels, h // 2, w // 2)
        noise = torch.cat(
            [torch.randn(shape, generator=g, device=g.device, dtype=torch.float32) for g in generators]
        )
        # contiguous: the packing is a permuted view, and the trajectory's stored latents (and so
        # the trainer's recomputation) are contiguous; a reduction over the two layouts (the SDE
        # step's log-prob mean) sums in another order and rounds differently
        return self.pipe._pack_latents(noise).contiguous().to(self.device)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> Schedule:
        """The pipeline's `set_timesteps(sigmas=linspace(1, 1/N, N), mu=compute_empirical_mu(
        image tokens, N))` on a fresh scheduler from the model's config, with a final σ = 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1; got {num_steps!r}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(euler_config(self.scheduler_config, "flux"))
        if scheduler.config.get("use_flow_sigmas"):
            raise ValueError(
                "this FLUX.2 scheduler config has use_flow_sigmas=True, which diffrl does not sample"
            )
        mu = compute_empirical_mu(
            image_seq_len=self.image_seq_len(height, width, num_frames), num_steps=num_steps
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
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
        """fp32 velocity [B, N, 128] for packed fp32 latents at model timesteps 1000·σ; with CFG
        (g > 1, negatives, a base checkpoint) one forward of [negative, positive] rows combined
        as v_u + g·(v_c − v_u) (module docstring)."""
        self._require_no_true_cfg(true_cfg_scale)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        h, w = self._latent_hw(height, width, num_frames)
        hidden = latents.to(self.device, self.dtype)
        timestep = timestep_B.to(self.device, self.dtype)  # as the pipeline: t.expand(B).to(dtype)
        embeds = cond.embeds
        # CFG as one batched call ([negatives; prompts], then chunk and combine): the same block is
        # in sd3.py, flux.py, qwen_image.py, wan.py (here: classic CFG, the pipeline runs two calls).
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale)
        if do_cfg:
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond.negative_embeds, embeds])
        embeds = embeds.to(self.device, self.dtype)
        img_ids = self.pipe._prepare_latent_ids(hidden.new_empty(1, 1, h // 2, w // 2)).to(self.device)
        txt_ids = self.pipe._prepare_text_ids(embeds[:1]).to(self.device)
        tokens = hidden.shape[1]
        out = self.run_transformer(
            hidden_states=hidden,
            timestep=timestep / 1000,
            guidance=self._guidance(guidance_scale, hidden.shape[0]),
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0][:, :tokens].float()
        if not do_cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _guidance(self, guidance_scale: float, rows: int) -> torch.Tensor | None:
        """The transformer's `guidance` input: none for [klein] (its pipeline passes None)."""
        return None

    def _unpack(self, latents: torch.Tensor, ids: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Tokens [B, h·w, C] -> [B, C, h, w] with the pipeline's own `_unpack_latents_with_ids`."""
        return self.pipe._unpack_latents_with_ids(latents, ids, h, w)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed normalised latents -> uint8 [B, 3, H, W], as the pipeline after its loop."""
        h, w = self._latent_hw(height, width, num_frames)
        pipe, vae = self.pipe, self.pipe.vae
        with torch.no_grad():
            latents = latents.to(self.device, vae.dtype)
            ids = pipe._prepare_latent_ids(latents.new_empty(latents.shape[0], 1, h // 2, w // 2)).to(
                self.device
            )
            latents = self._unpack(latents, ids, h // 2, w // 2)
            mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
                latents.device, latents.dtype
            )
            latents = pipe._unpatchify_latents(latents * std + mean)
            images = vae.decode(latents, return_dict=False)[0]
        return to_uint8(images)

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of every linear and of attention (QK^T, AV) in one `Flux2Transformer2DModel` forward.

        D = heads·head_dim, M = int(D·mlp_ratio) (the SwiGLU width), N_i image tokens, N_t text
        tokens, N = N_i + N_t. Per sample:
          embedders: timestep MLP 256·D + D² (twice with a guidance embedding), the shared
            modulations D·6D (image), D·6D (text), D·3D (single stream), x_embedder N_i·C_in·D,
            context_embedder N_t·J·D;
          double-stream block: each stream's q, k, v, out (4D²) and SwiGLU MLP (D·2M + M·D) on its
            own tokens -> (N_i + N_t)·(4D² + 3MD), joint attention 2·N²·D;
          single-stream block: fused qkv+MLP in (D·(3D + 2M)) and out ((D + M)·D) on all N tokens
            -> N·(4D² + 3MD), attention 2·N²·D;
          output: norm_out D·2D, proj_out N_i·D·C_out.
        RoPE, norms, gates and softmax are elementwise and not counted.
        """
        if cond_tokens:
            raise ValueError(
                f"{self.pipeline_class_name} text-to-image takes no condition images: cond_tokens must be 0"
            )
        cfg = self.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        m = int(d * cfg.mlp_ratio)
        n_img, n_txt = self.image_seq_len(height, width, num_frames), text_len
        n = n_img + n_txt
        per_token = 4 * d * d + 3 * m * d
        macs = (cfg.timestep_guidance_channels * d + d * d) * (2 if cfg.guidance_embeds else 1)
        macs += d * 6 * d * 2 + d * 3 * d
        macs += n_img * cfg.in_channels * d + n_txt * cfg.joint_attention_dim * d
        macs += cfg.num_layers * (n * per_token + 2 * n * n * d)
        macs += cfg.num_single_layers * (n * per_token + 2 * n * n * d)
        macs += d * 2 * d + n_img * d * cfg.patch_size**2 * (cfg.out_channels or cfg.in_channels)
        return float(2 * batch * macs)


# ---------------------------------------------------------------------------------- tiny builders
def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random step-distilled FLUX.2 [klein] pipeline (as FLUX.2-klein-4B) to `path`."""
    tiny_pipeline(seed, distilled=True).save_pretrained(path)
    return Path(path)


def build_tiny_base(path: Path, seed: int = 0) -> Path:
    """Write a tiny random FLUX.2 [klein] base pipeline (CFG; as FLUX.2-klein-base-4B) to `path`."""
    tiny_pipeline(seed, distilled=False).save_pretrained(path)
    return Path(path)


def tiny_pipeline(seed: int = 0, distilled: bool = True):
    """A tiny random `Flux2KleinPipeline` of real classes at small sizes.

    `Flux2Transformer2DModel`: 2 double- and 2 single-stream blocks, D = 32 (2 heads x 16, RoPE
    axes 4/4/4/4), no guidance embedding, 128 input channels (32 VAE channels x 2 x 2) as the real
    ones; `AutoencoderKLFlux2` with 32 latent channels and an 8x downsampling (4 blocks), its
    batch-norm statistics set to random values (so that normalisation matters); a `Qwen3ForCausalLM`
    text encoder with 28 layers of width 16 (the pipeline reads layers 9, 18 and 27: text features
    of 48), the tokenizer of `zimage.tiny_qwen3_tokenizer`; `FLUX2_SCHEDULER_CONFIG`. 32x32
    images give 4 image tokens.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from diffrl.models.zimage import tiny_qwen3_tokenizer

    text_dim = 16
    tokenizer = tiny_qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=32,
                num_hidden_layers=max(TEXT_LAYERS) + 1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=2048,
                bos_token_id=ids("<|endoftext|>"),
                eos_token_id=ids("<|im_end|>"),
                pad_token_id=ids("<|endoftext|>"),
            )
        )
        vae = tiny_vae()
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=len(TEXT_LAYERS) * text_dim,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
        is_distilled=distilled,
    )


def tiny_vae():
    """The tiny FLUX.2 VAE (both FLUX.2 families'): `AutoencoderKLFlux2` with 32 latent channels and
    an 8x downsampling (4 blocks), its batch-norm statistics set to random values (so that the
    normalisation matters), from the current random state."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=4,
        sample_size=64,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return vae


__all__ = ["Flux2KleinAdapter", "build_tiny", "build_tiny_base"]
