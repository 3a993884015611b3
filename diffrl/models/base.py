"""The contract between a model family and the rest of diffrl.

A `ModelAdapter` wraps one loaded diffusers pipeline (its transformer, VAE, text encoders,
tokenizers and scheduler config) and exposes the few operations RL needs, so that the sampler,
the trainer and the benchmarks never branch on the family:

    encode_prompts  -> PromptEmbeds        (once per unique prompt)
    schedule        -> Schedule            (sigmas and model timesteps for a step count and size)
    init_noise      -> latents             (per-sample seeded, in the layout `velocity` consumes)
    velocity        -> v                   (CFG computed inside, from one batched forward)
    decode          -> uint8 pixels        ([B,3,H,W] images, [B,T,3,H,W] videos)

plus declared facts: transformer block classes (FSDP units, activation checkpointing, compile;
found by `diffrl.models.blocks`), default LoRA target modules, and an honest FLOPs count per
forward.

Latents handed to and returned by adapters are fp32 (the trajectory's dtype); the network runs in
the adapter's compute dtype and its output is cast back to fp32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline
from tensordict import tensorclass

from diffrl.files import read_json_file
from diffrl.models.blocks import _GRAPHS_PER_STRUCTURE, _block_structure, find_blocks
from diffrl.models.conditions import ConditionRule
from diffrl.schedules import Schedule, flow_match_schedule

#: The fix for a model directory whose files do not parse.
MODEL_DIR_FIX = (
    "the model directory is damaged: copy the model again, or save it with pipeline.save_pretrained(dir)"
)


@tensorclass
class PromptEmbeds:
    """Text conditioning for P prompts (the batch dimension), as the family's transformer takes it.

    `embeds` [P, L, D] is what the transformer attends to; `mask` [P, L] marks real tokens where the
    family uses variable-length text (Qwen-Image); `pooled` [P, D'] is the pooled text vector of
    SD3/FLUX. The `negative_*` fields are the unconditional side of CFG (None without CFG). Rows
    are indexed like any tensorclass (`embeds[idx]`), so a sampler encodes each unique prompt once
    and gathers rows for its (prompt, sample) pairs.

    Image-edit families (`ModelAdapter.condition_rule`) condition on images too: `cond_latents`
    [P, N_c, C] are the condition images' VAE latents in the family's packed token layout (all of a
    row's images, concatenated along the tokens, as the pipeline appends them to the noisy latents),
    and `cond_shapes` [P, K, 2] (int64) the token grid (rows, columns) of each of the K images, from
    which the family builds its position ids. They are part of the conditioning table, so the
    sampler and the trainer's recomputation see the same condition latents (computed once per
    (prompt, images) pair), and both CFG sides share them.
    """

    embeds: torch.Tensor
    mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None
    cond_shapes: torch.Tensor | None = None

    @property
    def has_negative(self) -> bool:
        return self.negative_embeds is not None

    @property
    def cond_tokens(self) -> int:
        """Condition-image tokens per row (0 without condition images)."""
        return 0 if self.cond_latents is None else int(self.cond_latents.shape[1])

    @staticmethod
    def cat_padded(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate prompt tables whose text lengths may differ: a family that pads each batch of
        prompts to its longest (Qwen-Image) gives tables of different lengths, so right-pad with
        zeros to the longest overall and extend the masks with zeros (padded keys are masked out,
        so the model computes the same thing)."""
        lengths = {p.embeds.shape[1] for p in parts} | {
            p.negative_embeds.shape[1] for p in parts if p.negative_embeds is not None
        }
        if len(lengths) == 1:
            return torch.cat(list(parts))
        if any(p.mask is None for p in parts):
            raise ValueError(
                f"prompt embeddings of different text lengths {sorted(lengths)} without attention "
                "masks: this family must pad every prompt to rollout.pipeline.max_sequence_length"
            )
        length = max(lengths)
        padded = []
        for p in parts:
            negative = p.negative_embeds is not None
            padded.append(
                PromptEmbeds(
                    embeds=_pad_tokens(p.embeds, length),
                    mask=_pad_tokens(p.mask, length),
                    pooled=p.pooled,
                    negative_embeds=_pad_tokens(p.negative_embeds, length) if negative else None,
                    negative_mask=_pad_tokens(p.negative_mask, length) if negative else None,
                    negative_pooled=p.negative_pooled,
                    cond_latents=p.cond_latents,
                    cond_shapes=p.cond_shapes,
                    batch_size=p.batch_size,
                )
            )
        return torch.cat(padded)


def _pad_tokens(values: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad dim 1 (tokens) with zeros to `length`."""
    pad = [0, 0] * (values.dim() - 2) + [0, length - values.shape[1]]
    return torch.nn.functional.pad(values, pad)


class ModelAdapter(ABC):
    """One model family. Subclasses set the class attributes and implement the abstract methods."""

    #: `_class_name` of the directory's model_index.json this adapter loads.
    pipeline_class_name: ClassVar[str]
    #: How the family's diffusers pipeline calls its scheduler (see `diffrl.schedules`).
    schedule_convention: ClassVar[str]
    #: Names of the transformer's repeated block classes: FSDP units, checkpointing, compile.
    block_class_names: ClassVar[tuple[str, ...]]
    #: How many distinct text lengths a family's blocks see: families that pad every prompt to one
    #: length see 1; one that pads to the longest prompt of a batch (rounded to a bucket) sees up to
    #: this many, and each is a separate static graph (compile_blocks).
    text_length_buckets: ClassVar[int] = 1
    #: Module names LoRA adapts when `model.lora.target_modules` is null.
    default_lora_target_modules: ClassVar[tuple[str, ...]]
    #: True for video families: pixels come out as [B, T, 3, H, W].
    is_video: ClassVar[bool] = False
    #: How error messages name the latent layout `velocity` expects.
    latent_layout: ClassVar[str] = "the latent layout"
    #: The most text tokens `encode_prompts` takes (`max_sequence_length`): the family's text
    #: encoder or pipeline limit, checked from the model directory before the model loads.
    max_text_tokens: ClassVar[int]
    #: Components loaded in a dtype of their own instead of `model.dtype` (e.g. Wan's VAE in fp32).
    component_dtypes: ClassVar[dict[str, torch.dtype]] = {}
    #: Image-edit families: the condition images a prompt row carries (count, aspect ratio, the size
    #: they are encoded at), checked on the prompt file before the model loads; None = text only.
    condition_rule: ClassVar[ConditionRule | None] = None
    #: The attention backend (`model.attn_backend`) this family trains with on a GPU where torch's
    #: default choice is known to fail its backward; None where the default trains.
    gpu_training_attn_backend: ClassVar[str | None] = None

    def __init__(self, pipe: DiffusionPipeline, device: torch.device, dtype: torch.dtype):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.compiled = False  # set by compile_blocks: no-grad and grad graphs then round differently
        # actor.micro_batch_size of the engine training this module (set by TrainEngine), so that a
        # sampler sharing the module computes its window steps as the trainer will
        self.train_micro_batch_size: int | None = None
        # Set by inject_lora: fp32 adapter weights in a bf16/fp16 model compute under autocast
        self.lora_autocast = False

    @classmethod
    def from_pretrained(cls, path, device: torch.device, dtype: torch.dtype) -> ModelAdapter:
        """Load with diffusers' own `from_pretrained`, local files only (nothing from a hub)."""
        dtypes = {"default": dtype, **cls.component_dtypes}
        # A component saved as [null, null] (the toy model's VAE and T5) must be passed as None
        # explicitly: diffusers refuses to load a pipeline with a required component missing.
        index = read_json_file(Path(path) / "model_index.json", "model index", MODEL_DIR_FIX)
        absent = {
            name: None
            for name, spec in index.items()
            if not name.startswith("_") and isinstance(spec, list) and spec[0] is None
        }
        pipe = DiffusionPipeline.from_pretrained(
            str(path), dtype=dtypes, local_files_only=True, **absent, **cls.loaded_components(Path(path))
        )
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        return cls(pipe, device, dtype)

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        """Components this family loads itself and hands to `from_pretrained` (none by default)."""
        return {}

    # ------------------------------------------------------------------------------ components
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def trains_through_compiled_graph(self) -> bool:
        """Whether the trained policy's window steps must run with grad on to be the update's
        bit for bit: compiled blocks run another graph with grad (partitioned for the backward,
        fused and so rounded differently) than without, and this module has an update's
        micro-batch size (`train_micro_batch_size`) and trainable weights, as the trainer's
        module and a compiled LoRA replica's have. The sampler, the trainer's recompute and a
        replica's old-log-prob pass all ask here."""
        return (
            self.compiled
            and bool(self.train_micro_batch_size)
            and any(p.requires_grad for p in self.transformer.parameters())
        )

    def run_transformer(self, **inputs):
        """The transformer's forward, as every `velocity` calls it.

        LoRA weights are fp32 (AdamW's master weights) in a bf16 or fp16 model. Left alone, peft
        computes each adapted layer in fp32, casting its input up: on an SD3.5-Medium update step
        on an H100 that cost 17% (27.9% MFU against 33.1% under autocast,
        `benchmarks/train_step.py --compile [--autocast]`). Autocast runs those matmuls in the
        model's dtype, as mixed-precision training does, while the weights and their gradients
        stay fp32. Sampler and trainer both come through here, so their computations stay the same.
        """
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.lora_autocast):
            return self.transformer(**inputs)

    @property
    def scheduler_config(self):
        return self.pipe.scheduler.config

    @property
    def lora_file_class(self) -> type:
        """The diffusers class whose `save_lora_weights` writes this family's LoRA file: the
        pipeline's own class (which loads it back with `load_lora_weights`), unless the family's
        pipeline has no LoRA mixin and declares the class that writes its transformer's format."""
        return type(self.pipe)

    def compile_blocks(self, **compile_kwargs) -> int:
        """Regional compilation: `torch.compile` each declared transformer block in place.

        The blocks repeat, so one compiled graph serves all blocks of one structure and compile
        time stays short (the same technique as diffusers' `compile_repeated_blocks`). Returns how
        many were compiled.

        All blocks share one code object (`forward`), and dynamo keeps one cache with one
        recompile limit per code object, while RL needs several graphs per block structure:
        sampling (no grad), reference (adapters disabled), training (grad on, with the block input
        requiring grad or not), each at its micro-batch size. Past torch's default limit of 8 the
        remaining variants silently run eager (SD3.5-M has 3 structures: dual attention, single,
        and the context-pre-only last block), so the limit is raised to the default per structure,
        times the family's `text_length_buckets` (Qwen-Image's text length varies with the prompts).
        Shapes are static (`dynamic=False`): micro-batch sizes are few and fixed, and a dynamic
        graph would differ between the sampler's and the trainer's batch sizes.
        """
        blocks = find_blocks(self.transformer, self.block_class_names)
        structures = {_block_structure(block) for block in blocks}
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(
            dynamo.recompile_limit, _GRAPHS_PER_STRUCTURE * len(structures) * self.text_length_buckets
        )
        for block in blocks:
            block.compile(**{"dynamic": False, **compile_kwargs})
        self.compiled = True
        return len(blocks)

    # ------------------------------------------------------------------------------ text
    @abstractmethod
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """Encode P prompts (and their negatives when CFG is on; None = no CFG) without grad."""

    def encode_conditioned(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
        images: Sequence[Sequence[Any]],
    ) -> PromptEmbeds:
        """`encode_prompts` for image-edit families: each prompt with its condition images (Pillow
        RGB images, `images[i]` for prompt i), encoded as the family's pipeline encodes them into
        `cond_latents` / `cond_shapes` (and, where the text encoder sees the images, the embeds)."""
        raise self._text_only_error()

    def _text_only_error(self) -> ValueError:
        return ValueError(
            f"{type(self).__name__} ({self.pipeline_class_name}) generates from text only and takes no "
            "condition images: use an image-edit model (docs/models.md), or leave the images out "
            "(data.image_key is read only for edit models; diffrl sample without --image)"
        )

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Whether these guidance settings run an unconditional pass on negative-prompt embeddings.

        Classic CFG families (SD3, Wan): guidance_scale > 1. Families whose `guidance_scale` is a
        distilled guidance embedding (FLUX) or unused (Qwen-Image) override this and look at
        `true_cfg_scale` instead.
        """
        return guidance_scale > 1.0

    def _prompt_batch(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
        family: str,
    ) -> list[str]:
        """`prompts` as a list, after the checks every `encode_prompts` makes: a sequence of
        strings (not one string), at least one, `max_sequence_length` in 1..`self.max_text_tokens`
        (`family` names the model in the error), one negative per prompt."""
        if isinstance(prompts, str):
            raise ValueError(
                f"prompts must be a sequence of strings, not one string: wrap it as [{prompts!r}]"
            )
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        if not 1 <= max_sequence_length <= self.max_text_tokens:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} is out of range for {family}: "
                f"use 1..{self.max_text_tokens}"
            )
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: pass one per prompt"
            )
        return prompts

    def _require_no_true_cfg(self, true_cfg_scale: float | None) -> None:
        """For classic-CFG families, whose `guidance_scale` already is CFG."""
        if true_cfg_scale is not None:
            raise ValueError(
                f"true_cfg_scale={true_cfg_scale} does not apply to {type(self).__name__}: its CFG scale is "
                "guidance_scale (rollout.pipeline.guidance_scale); set rollout.pipeline.true_cfg_scale=null"
            )

    # ------------------------------------------------------------------------------ latents
    @abstractmethod
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """One sample's latent shape in the layout `velocity` consumes (packed where the family packs)."""

    @abstractmethod
    def image_seq_len(self, height: int, width: int, num_frames: int = 1) -> int:
        """Image tokens the transformer sees for one sample (sets dynamic shift and FLOPs)."""

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> Schedule:
        return flow_match_schedule(
            self.scheduler_config,
            num_steps,
            self.image_seq_len(height, width, num_frames),
            pipeline_convention=self.schedule_convention,
        )

    def init_noise(
        self, generators: Sequence[torch.Generator], height: int, width: int, num_frames: int = 1
    ) -> torch.Tensor:
        """fp32 standard-normal latents, one draw per generator (per sample), on the adapter's device.

        Each sample draws from its own generator, so its noise does not depend on which micro-batch
        it lands in.
        """
        shape = self.latent_shape(height, width, num_frames)
        return torch.cat(
            [torch.randn((1, *shape), generator=g, device=g.device, dtype=torch.float32) for g in generators]
        ).to(self.device)

    # ------------------------------------------------------------------------------ network
    @abstractmethod
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
        """fp32 velocity for fp32 `latents` [B, ...] at model timesteps `timestep_B` (Schedule.timesteps).

        `cond` has one row per sample. With CFG (`cond.has_negative` and `wants_negative(...)`) the
        conditional and unconditional halves run as one batched forward of 2B. `guidance_scale` is
        the family's pipeline argument of that name (classic CFG for SD3/Wan, the distilled
        guidance embedding for FLUX); `true_cfg_scale` is the pipelines' true CFG (FLUX, and
        Qwen-Image with norm rescale), None = off; families without it raise when it is set.
        Differentiable: the trainer calls it with grad enabled.
        """

    def _velocity_inputs(
        self, latents: torch.Tensor, timestep_B, cond: PromptEmbeds, height: int, width: int, num_frames: int
    ) -> torch.Tensor:
        """Check that latents, timesteps and conditioning rows line up (one of each per sample);
        returns the timesteps as fp32 [B] on the adapter's device (a scalar is broadcast)."""
        batch = latents.shape[0]
        expected = tuple(self.latent_shape(height, width, num_frames))
        if tuple(latents.shape[1:]) != expected:
            raise ValueError(
                f"latents shape {tuple(latents.shape)} is not {self.latent_layout} "
                f"[B, {', '.join(map(str, expected))}] for {height}x{width}, {num_frames} frame(s)"
            )
        timestep_B = torch.as_tensor(timestep_B, device=self.device, dtype=torch.float32)
        if timestep_B.ndim == 0:
            timestep_B = timestep_B.expand(batch)
        if cond.batch_size[0] != batch or timestep_B.shape != (batch,):
            raise ValueError(
                f"velocity got {batch} latents, {cond.batch_size[0]} conditioning rows and timesteps of shape "
                f"{tuple(timestep_B.shape)}: pass one conditioning row and one timestep per sample"
            )
        return timestep_B

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Final latents -> uint8 pixels [B, 3, H, W] (images) or [B, T, 3, H, W] (videos), no grad."""

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 images [B, 3, H, W] -> fp32 latents in the layout `velocity` consumes (the inverse of
        `decode`), for supervised flow matching (`diffrl sft`). Families without it raise."""
        raise ValueError(
            f"{type(self).__name__} cannot encode images yet, so `diffrl sft` does not support it; "
            "supervised fine-tuning supports the SD3 family (including the pixel-space toy model) and "
            "the FLUX.1 family (FLUX.1, FLUX.1 Kontext, including the pixel-space shapes edit model)"
        )

    # ------------------------------------------------------------------------------ the reference
    @property
    def no_pipeline_reference(self) -> str | None:
        """Why this model has no diffusers pipeline call to compare the sampler with (`diffrl
        check` then skips that row), or None: it has one (`pipeline_call`)."""
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
        """Keyword arguments of the family's own diffusers pipeline call that samples, with its ODE
        loop, what diffrl's sampler samples with these settings and negatives (`diffrl check`
        compares the two from the same initial noise). Classic CFG families (SD3, Wan): the
        pipeline's `guidance_scale` is the CFG scale and its negatives are ours. `images`: each
        prompt's condition images, for image-edit families (others raise)."""
        self._require_no_true_cfg(true_cfg_scale)
        self._require_no_images(images)
        kwargs: dict[str, Any] = dict(
            prompt=list(prompts),
            negative_prompt=list(negative_prompts) if negative_prompts is not None else None,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )
        if self.is_video:
            kwargs["num_frames"] = num_frames
        return kwargs

    def _require_no_images(self, images: Sequence[Sequence[Any]] | None) -> None:
        if images is not None and self.condition_rule is None:
            raise self._text_only_error()

    def reference_pipeline(self) -> DiffusionPipeline:
        """The diffusers pipeline the sampler must agree with: the loaded one, on the same modules."""
        return self.pipe

    def pipeline_latents(self, latents: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
        """The reference pipeline's final latents (`output_type="latent"`, the layout `velocity`
        consumes) from initial `latents`, for the keyword arguments of `pipeline_call`."""
        out = self.reference_pipeline()(latents=latents, output_type="latent", **call)
        return out.frames if self.is_video else out.images

    # ------------------------------------------------------------------------------ facts
    @abstractmethod
    def flops_per_forward(
        self, batch: int, height: int, width: int, text_len: int, num_frames: int = 1, cond_tokens: int = 0
    ) -> float:
        """Transformer FLOPs of one forward over `batch` samples (a CFG pair counts as 2 samples).

        Count 2·(multiply-accumulates) of every matmul including attention scores and values; in
        two-stream (MMDiT) blocks each stream's weights see only that stream's tokens.
        `cond_tokens`: condition-image tokens per sample (`PromptEmbeds.cond_tokens`; edit
        families append them to the image tokens, so they go through every image-stream weight).
        """


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] (any float dtype) -> uint8 in [0, 255], rounding like diffusers' postprocess."""
    return ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
