"""Rollout throughput: diffrl's sampler vs diffusers' StableDiffusion3Pipeline, same weights, same settings.

An SD3.5-Medium-sized transformer and the SD3 VAE (real diffusers classes, random weights, bf16),
prompt embeddings random with the real shapes (CLIP 77 + T5 256 tokens × 4096, pooled 2048), 512²,
10 steps, CFG 4.5. Prints one JSON line: images/s of both, the transformer's MFU (FLOPs from the
adapter's analytic count, cross-checked with torch's FlopCounterMode on one forward) against the
accelerator's dense bf16 peak, VAE decode time, and peak memory.

    python benchmarks/rollout.py                     # GPU, 32 images
    python benchmarks/rollout.py --no-compile        # eager sampler
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from torch.utils.flop_counter import FlopCounterMode

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig
from diffrl.models.base import PromptEmbeds
from diffrl.models.sd3 import SD3Adapter
from diffrl.rollout import TrajectorySampler
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets

H100_BF16_DENSE_TFLOPS = 989.0

# stabilityai/stable-diffusion-3.5-medium transformer/config.json
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# the SD3 / SD3.5 VAE (vae/config.json)
SD3_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
TEXT_TOKENS = 77 + 256


class RandomTextSD3Adapter(SD3Adapter):
    """SD3 with the text encoders replaced by random embeddings of the real shapes (fixed per prompt)."""

    def encode_prompts(
        self, prompts: Sequence[str], negative_prompts, max_sequence_length: int
    ) -> PromptEmbeds:
        g = torch.Generator(self.device).manual_seed(len(prompts))
        rand = lambda *shape: torch.randn(*shape, generator=g, device=self.device, dtype=self.dtype)  # noqa: E731
        p = len(prompts)
        return PromptEmbeds(
            embeds=rand(p, TEXT_TOKENS, 4096),
            pooled=rand(p, 2048),
            negative_embeds=rand(p, TEXT_TOKENS, 4096) if negative_prompts is not None else None,
            negative_pooled=rand(p, 2048) if negative_prompts is not None else None,
            batch_size=[p],
        )


def transformer_config(layers: int = 24) -> dict:
    """SD3.5-Medium's transformer config, optionally with fewer layers (CPU smoke runs)."""
    config = {**SD35_MEDIUM, "num_layers": layers}
    config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < layers)
    return config


def random_sd35_adapter(layers: int, device: torch.device, dtype: torch.dtype) -> RandomTextSD3Adapter:
    """SD3.5-Medium-sized transformer and the SD3 VAE with random weights (seed 0: identical on every
    rank), no text encoders, wrapped in the SD3 adapter with random text embeddings."""
    torch.manual_seed(0)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**transformer_config(layers)),
        vae=AutoencoderKL(**SD3_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    ).to(device, dtype)
    pipe.set_progress_bar_config(disable=True)
    return RandomTextSD3Adapter(pipe, device, dtype)


def update_batch(adapter: SD3Adapter, args: argparse.Namespace) -> PolicyGradientBatch:
    """What the update benchmarks (`train_step.py`, `offload.py`) train on, from their shared flags:
    one rollout of `args.images` trajectories (`images // n` prompts × `n`, `micro_batch` per
    forward, `size`², CFG 4.5, an SDE window of `window` steps in the first half of `steps`) with
    advantages spread evenly over [-1, 1]. Seed 0: the same on every rank."""
    rollout_cfg = RolloutConfig(
        n=args.n,
        micro_batch_size=args.micro_batch,
        pipeline=PipelineConfig(
            height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=4.5
        ),
        sde=SdeConfig(noise_level=0.7, window_size=args.window, window_range=[0, args.steps // 2]),
    )
    prompts = [f"prompt {i}" for i in range(args.images // args.n)]
    rollout = TrajectorySampler(adapter, rollout_cfg, progress=False).sample(prompts, seed=0, step=0)
    advantages = torch.linspace(-1, 1, len(rollout), device=adapter.device)
    return PolicyGradientBatch(rollout, TrainingTargets(advantages_B=advantages, batch_size=[len(rollout)]))


def cuda_time(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="images per sampler forward (x2 with CFG)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
    parser.add_argument("--layers", type=int, default=24, help="fewer layers for a quick CPU smoke run")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or smoke-test with --device cpu --layers 1 --size 64")

    adapter = random_sd35_adapter(args.layers, device, dtype)
    pipe = adapter.pipe
    config = transformer_config(args.layers)
    size, steps, prompts_n = args.size, args.steps, args.images // args.n
    prompts = [f"prompt {i}" for i in range(prompts_n)]
    images = prompts_n * args.n

    # FLOPs: the adapter's analytic count, checked against torch's counter on one real forward.
    fwd_batch = 2 * args.micro_batch if args.guidance > 1 else args.micro_batch
    flops_step = adapter.flops_per_forward(
        2 * images if args.guidance > 1 else images, size, size, TEXT_TOKENS
    )
    emb = adapter.encode_prompts(["x"], ["x"], 256)
    lat = torch.randn(1, *adapter.latent_shape(size, size), device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.velocity(lat, torch.full((1,), 500.0, device=device), emb, args.guidance, size, size)
    flops_counted_pair = counter.get_total_flops()
    flops_analytic_pair = adapter.flops_per_forward(2, size, size, TEXT_TOKENS)

    cfg = RolloutConfig(
        n=args.n,
        micro_batch_size=args.micro_batch,
        pipeline=PipelineConfig(
            height=size,
            width=size,
            num_inference_steps=steps,
            guidance_scale=args.guidance,
            max_sequence_length=256,
        ),
        sde=SdeConfig(type="sde", noise_level=0.7),
    )
    sampler = TrajectorySampler(adapter, cfg, progress=False)

    def decode_only(latents):
        return adapter.decode(latents, size, size)

    results: dict = {
        "bench": "rollout",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "layers": args.layers,
        "torch": torch.__version__,
        "images": images,
        "size": size,
        "steps": steps,
        "guidance": args.guidance,
        "fwd_batch": fwd_batch,
        "compiled": not args.no_compile,
        "flops_per_cfg_pair_analytic": flops_analytic_pair,
        "flops_per_cfg_pair_counted": flops_counted_pair,
    }

    # ---- diffrl sampler
    if not args.no_compile:
        _, results["compile_s"] = cuda_time(lambda: adapter.compile_blocks())
    reset_peak_memory()
    _, results["diffrl_warmup_s"] = cuda_time(lambda: sampler.sample(prompts, seed=0, step=0))
    times = []
    for r in range(args.repeats):
        rollout, t = cuda_time(lambda r=r: sampler.sample(prompts, seed=0, step=r + 1))
        times.append(t)
    t_total = min(times)
    _, t_decode = cuda_time(
        lambda: [decode_only(c) for c in rollout.samples.final_latents.split(args.micro_batch)]
    )
    results["diffrl_peak_mem_gb"] = peak_memory_gb()
    results["diffrl_s"] = t_total
    results["diffrl_decode_s"] = t_decode
    results["diffrl_images_per_s"] = images / t_total
    results["diffrl_transformer_mfu"] = flops_step * steps / (t_total - t_decode) / (args.peak_tflops * 1e12)

    # ---- diffusers pipeline, same weights (uncompiled: the plain pipeline), same embeddings
    if not args.no_compile:
        pipe.transformer = SD3Transformer2DModel(**config).to(device, dtype)
        pipe.transformer.load_state_dict(
            {k.replace("._orig_mod", ""): v for k, v in adapter.transformer.state_dict().items()}
        )
    emb = adapter.encode_prompts(prompts, prompts, 256)
    rows = torch.arange(prompts_n, device=device).repeat_interleave(args.n)

    def run_pipe(output_type):
        outs = []
        for chunk in rows.split(args.micro_batch):
            e = emb[chunk]
            outs.append(
                pipe(
                    prompt_embeds=e.embeds,
                    pooled_prompt_embeds=e.pooled,
                    negative_prompt_embeds=e.negative_embeds,
                    negative_pooled_prompt_embeds=e.negative_pooled,
                    num_inference_steps=steps,
                    guidance_scale=args.guidance,
                    height=size,
                    width=size,
                    output_type=output_type,
                ).images
            )
        return outs

    reset_peak_memory()
    cuda_time(lambda: run_pipe("latent"))  # warmup
    t_pipe = min(cuda_time(lambda: run_pipe("pt"))[1] for _ in range(args.repeats))
    t_pipe_latent = min(cuda_time(lambda: run_pipe("latent"))[1] for _ in range(args.repeats))
    results["diffusers_peak_mem_gb"] = peak_memory_gb()
    results["diffusers_s"] = t_pipe
    results["diffusers_images_per_s"] = images / t_pipe
    results["diffusers_transformer_mfu"] = flops_step * steps / t_pipe_latent / (args.peak_tflops * 1e12)
    results["speedup_vs_diffusers"] = t_pipe / t_total
    print(json.dumps(results))


if __name__ == "__main__":
    main()
