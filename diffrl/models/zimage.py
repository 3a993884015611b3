"""Z-Image and Z-Image-Turbo (`ZImagePipeline`): the adapter and a tiny random builder.

What the diffusers pipeline does (diffusers 0.42), and therefore what this adapter does:

- Text: each prompt goes through the tokenizer's chat template (one user message, generation
  prompt, `enable_thinking=True`: `<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`
  with Qwen3's template), is tokenized and padded to `max_sequence_length`, and the Qwen3 text
  encoder's second-to-last hidden layer is kept for the real tokens only: one [L_i, D] tensor per
  prompt, of its own length. `encode_prompts` stores them zero-padded to one length with a mask
  (`PromptEmbeds.mask`, 1 = real token), the length rounded up to a multiple of `TEXT_BUCKET`
  (32, as the transformer pads each caption itself) so that compiled blocks see few shapes;
  `velocity` hands the transformer each row's real tokens, exactly the pipeline's list.
- Latents: unpacked VAE latents fp32 [B, 16, H/8, W/8] (the FLUX.1 VAE); the transformer takes a
  list of per-sample [16, 1, H/8, W/8] tensors (a frame axis of 1) and patchifies 2x2 inside.
  `init_noise` draws them as the pipeline's `prepare_latents` (one [1, 16, H/8, W/8] draw per
  generator).
- Network call: `transformer(x=[...], t=(1000 − t)/1000, cap_feats=[...])` with t the scheduler's
  timestep 1000·σ, so the model's time runs 0 (noise) -> 1 (data); its output is the negative of
  the flow-matching velocity, which the pipeline negates before the Euler step (so does this).
- CFG, as the Z-Image model cards use it: `guidance_scale` g is the pipeline's, and CFG is on when
  g > 0, with the combination v = v_c + g·(v_c − v_u) (in fp32 per sample, as the pipeline): the
  classic CFG scale is g + 1. Z-Image-Turbo (distilled) is sampled with g = 0: one conditional
  pass per step, no negatives; Z-Image (the base model) with g ≈ 4 and a negative prompt. Both CFG
  halves run as ONE forward of [positive, negative] rows, in the pipeline's order. The pipeline's
  `cfg_normalization` and `cfg_truncation` stay at their defaults (off), which the model cards use.
- Schedule: the "flux" convention (explicit sigmas linspace(1, 1/N, N), `mu` from the image token
  count when the scheduler config uses dynamic shifting; Z-Image-Turbo's config has a static shift
  of 3.0, which the scheduler applies).
- Decode: latents / scaling_factor + shift_factor, `vae.decode`, uint8 (the pipeline's
  postprocess rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from diffrl.models.base import ModelAdapter, PromptEmbeds, to_uint8
from diffrl.models.tiny import tiny_kl_vae

#: Caption tokens are padded to a multiple of this (the transformer's `SEQ_MULTI_OF`, 32).
TEXT_BUCKET = 32
#: The transformer's adaLN embedding width cap and its timestep MLP's hidden width (fixed in diffusers).
_ADALN_EMBED_DIM = 256
_T_MID = 1024

#: Z-Image-Turbo's scheduler/scheduler_config.json (Tongyi-MAI/Z-Image-Turbo).
ZIMAGE_TURBO_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

#: Qwen3's chat template, reduced to what the pipeline asks of it (messages with a role and a
#: string content, the generation prompt, `enable_thinking`): the same text for those calls.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _bucket(length: int) -> int:
    return -(-length // TEXT_BUCKET) * TEXT_BUCKET


class ZImageAdapter(ModelAdapter):
    """Z-Image / Z-Image-Turbo: a single-stream DiT (`ZImageTransformerBlock`s: noise and caption
    refiners, then the joint layers) on Qwen3 text features."""

    pipeline_class_name: ClassVar[str] = "ZImagePipeline"
    # The pipeline's default max_sequence_length. Text and image share the first RoPE axis (the
    # image sits after the padded caption), whose table has 1024 positions.
    max_text_tokens: ClassVar[int] = 512
    schedule_convention: ClassVar[str] = "flux"
    latent_layout: ClassVar[str] = "the Z-Image latent layout"
    block_class_names: ClassVar[tuple[str, ...]] = ("ZImageTransformerBlock",)
    text_length_buckets: ClassVar[int] = 512 // TEXT_BUCKET
    # Attention projections and the SwiGLU MLP of every block (refiners included: peft matches
    # name suffixes), the targets of the Z-Image LoRA recipes (DiffSynth-Studio, ai-toolkit).
    default_lora_target_modules: ClassVar[tuple[str, ...]] = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        config = pipe.transformer.config
        if config.siglip_feat_dim is not None:
            raise ValueError(
                "this Z-Image transformer has siglip_feat_dim set (the Omni variant, ZImageOmniPipeline), "
                "which ZImagePipeline does not drive: load a text-to-image Z-Image checkpoint"
            )
        if tuple(config.all_patch_size) != (2,) or tuple(config.all_f_patch_size) != (1,):
            raise ValueError(
                f"this Z-Image transformer has all_patch_size={config.all_patch_size}, all_f_patch_size="
                f"{config.all_f_patch_size}; ZImagePipeline samples with patch 2 and frame patch 1 only"
            )

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` for the prompts (and the negatives), zero-padded to one length L
        with int64 masks (1 = real token); L is the longest encoded prompt of the call rounded up
        to a multiple of `TEXT_BUCKET`, but not past `max_sequence_length` (module docstring)."""
        prompts = self._prompt_batch(prompts, negative_prompts, max_sequence_length, "Z-Image")
        with torch.no_grad():
            sides = [self._encode(prompts, max_sequence_length)]
            if negative_prompts is not None:
                sides.append(self._encode(list(negative_prompts), max_sequence_length))
        longest = max(len(e) for side in sides for e in side)
        length = max(longest, min(_bucket(longest), max_sequence_length))
        embeds, mask = _pad_rows(sides[0], length)
        fields = {}
        if len(sides) > 1:
            fields["negative_embeds"], fields["negative_mask"] = _pad_rows(sides[1], length)
        return PromptEmbeds(embeds=embeds, mask=mask, **fields, batch_size=[len(prompts)])

    def _encode(self, prompts: list[str], max_sequence_length: int) -> list[torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return embeds

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """CFG is on for any guidance_scale > 0 (the pipeline's rule: v_c + g·(v_c − v_u))."""
        return guidance_scale > 0

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
        """The `ZImagePipeline` call of these settings: its `guidance_scale` is ours (0 = no CFG,
        one pass), with our negatives; CFG normalisation and truncation off (the defaults)."""
        self._require_no_true_cfg(true_cfg_scale)
        self._require_no_images(images)
        self._latent_hw(height, width, num_frames)
        cfg = negative_prompts is not None and self.wants_negative(guidance_scale)
        return dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if cfg else None,
            guidance_scale=guidance_scale if cfg else 0.0,
            cfg_normalization=False,
            cfg_truncation=1.0,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )

    # ------------------------------------------------------------------------------ latents
    def _latent_hw(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """VAE latent (h, w) = (H/8, W/8); H and W must be multiples of 16 (the pipeline's check)."""
        if num_frames != 1:
            raise ValueError(f"Z-Image generates images: num_frames must be 1; got {num_frames}")
        factor = self.pipe.vae_scale_factor
        multiple = factor * 2
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(
                f"Z-Image needs height and width that are positive multiples of {multiple} "
                f"(VAE factor {factor} x patch 2); got {height}x{width}"
            )
        return height // factor, width // factor

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """[16, H/8, W/8]: the VAE latent, unpacked (the transformer patchifies inside)."""
        h, w = self._latent_hw(height, width, num_frames)
        return (self.transformer.config.in_channels, h, w)

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
        """fp32 velocity [B, 16, H/8, W/8] at model timesteps 1000·σ: minus the transformer's output;
        with CFG (g > 0 and negatives) one forward of [positive, negative] rows combined as
        v_c + g·(v_c − v_u) (module docstring)."""
        self._require_no_true_cfg(true_cfg_scale)
        timestep_B = self._velocity_inputs(latents, timestep_B, cond, height, width, num_frames)
        hidden = latents.to(self.device, self.dtype)
        time = (1000 - timestep_B) / 1000  # as the pipeline, in fp32
        captions = _real_tokens(cond.embeds, cond.mask)
        # CFG as one batched call, then chunk and combine: the same block is in sd3.py, flux.py,
        # qwen_image.py, wan.py. Here the rows are [positive, negative], the pipeline's order.
        do_cfg = cond.has_negative and self.wants_negative(guidance_scale)
        if do_cfg:
            hidden = torch.cat([hidden, hidden])
            time = torch.cat([time, time])
            captions = captions + _real_tokens(cond.negative_embeds, cond.negative_mask)
        out = self.run_transformer(
            x=list(hidden.unsqueeze(2).unbind(0)),
            t=time,
            cap_feats=[c.to(self.device, self.dtype) for c in captions],
            return_dict=False,
        )[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if do_cfg:
            positive, negative = out.chunk(2)
            out = positive + guidance_scale * (positive - negative)
        return -out

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """uint8 [B, 3, H, W], as the pipeline decodes its final latents."""
        self._latent_hw(height, width, num_frames)
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
            images = vae.decode(z, return_dict=False)[0]
        return to_uint8(images)

    # ------------------------------------------------------------------------------ facts
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """2·MACs of every linear and of attention (QK^T, AV) in one `ZImageTransformer2DModel` forward.

        The transformer pads the image tokens and each caption to multiples of 32 (repeating the
        last token, then a learned pad token) and computes on the padding: N_x = pad32(image
        tokens), N_c = pad32(text_len), N = N_x + N_c. With D = dim, F = int(D/3·8) (SwiGLU width),
        E = min(D, 256), per sample:
          embedders: timestep MLP 256·1024 + 1024·E, x_embedder N_x·(4·C)·D, cap_embedder N_c·D_cap·D;
          a block over n tokens: q, k, v, out 4·n·D², attention 2·n²·D, MLP 3·n·D·F, adaLN E·4D
            (not in the caption refiner); the noise refiner runs on n = N_x, the caption refiner
            on N_c, the main layers on N;
          final layer: adaLN E·D, linear N·D·4C (on every token of the joint sequence).
        RoPE, norms, gates and softmax are elementwise and not counted.
        """
        if cond_tokens:
            raise ValueError("Z-Image takes no condition images: cond_tokens must be 0")
        cfg = self.transformer.config
        d, e = cfg.dim, min(cfg.dim, _ADALN_EMBED_DIM)
        ffn = int(d / 3 * 8)
        patch = 4 * cfg.in_channels
        n_x = _bucket(self.image_seq_len(height, width, num_frames))
        n_c = _bucket(text_len)
        n = n_x + n_c

        def block(tokens: int, modulated: bool) -> int:
            macs = 4 * tokens * d * d + 2 * tokens * tokens * d + 3 * tokens * d * ffn
            return macs + (e * 4 * d if modulated else 0)

        macs = 256 * _T_MID + _T_MID * e + n_x * patch * d + n_c * cfg.cap_feat_dim * d
        macs += cfg.n_refiner_layers * (block(n_x, True) + block(n_c, False))
        macs += cfg.n_layers * block(n, True)
        macs += e * d + n * d * patch
        return float(2 * batch * macs)


def _real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens [L_i, D] (the pipeline's list of captions)."""
    return [row[keep.bool()] for row, keep in zip(embeds, mask, strict=True)]


def _pad_rows(rows: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L_i, D] tensors -> zero-padded [P, length, D] and int64 masks [P, length]."""
    embeds = torch.stack([F.pad(r, (0, 0, 0, length - len(r))) for r in rows])
    mask = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = 1
    return embeds, mask


# ---------------------------------------------------------------------------------- tiny builder
def tiny_qwen3_tokenizer():
    """A byte-level BPE `Qwen2Tokenizer` built offline (`qwen_image_tiny.tiny_qwen2_tokenizer`, trained
    on Qwen3's chat format) carrying `QWEN3_CHAT_TEMPLATE`: the tokenizer of the tiny Z-Image and
    FLUX.2 [klein] pipelines, whose Qwen3 text encoders read chat-templated prompts."""
    from diffrl.models.qwen_image_tiny import tiny_qwen2_tokenizer

    # The template's prefix "<|im_start|>user\n" is 3 tokens: <|im_start|>, "user", "\n".
    tokenizer = tiny_qwen2_tokenizer("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", 3)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random Z-Image-Turbo-shaped pipeline (real diffusers/transformers classes) to `path`.

    `ZImageTransformer2DModel` with dim 32 (2 heads x 16, RoPE axes 4/6/6), 1 noise and 1 caption
    refiner block and 2 main layers, 16 latent channels, caption features of width 32; the FLUX.1
    VAE's shape (`tiny_kl_vae`, scaling 0.3611, shift 0.1159, as Z-Image's); a 2-layer `Qwen3Model`
    text encoder (hidden 32); a byte-level BPE `Qwen2Tokenizer` built offline with Qwen3's chat
    template (`QWEN3_CHAT_TEMPLATE`); Z-Image-Turbo's scheduler config (static shift 3). 32x32
    images give 4 image tokens (padded to 32 inside the transformer). Deterministic from `seed`.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    text_dim = 32
    tokenizer = tiny_qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=text_dim,
            axes_dims=[4, 6, 6],
            axes_lens=[1024, 512, 512],
        )
        text_encoder = Qwen3Model(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=2048,
                bos_token_id=ids("<|endoftext|>"),
                eos_token_id=ids("<|im_end|>"),
                pad_token_id=ids("<|endoftext|>"),
            )
        )
        vae = tiny_kl_vae(scaling_factor=0.3611, shift_factor=0.1159)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_TURBO_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
    )
    pipe.save_pretrained(path)
    return Path(path)


__all__ = ["ZImageAdapter", "build_tiny"]
