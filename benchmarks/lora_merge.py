"""Rollout throughput with LoRA adapters active vs merged into the weights (model.lora.merge_inference).

An SD3.5-Medium-sized transformer and the SD3 VAE (random weights, bf16, as benchmarks/rollout.py),
two LoRA adapters of rank 32 on the family's default target modules (the trained one and DiffusionNFT's
`old` one, both with non-zero random weights), diffrl's sampler at 512², 10 steps, CFG 4.5, eager
(no compile). Times the same rollout three ways: adapters active (what a LoRA run samples with
today), `merged_adapter` (the merge included in the time), and the base model without adapters (the
floor). Prints one JSON line: images/s of each, the merge's own time, peak memory, and how far the
merged rollout's final latents are from the unmerged one's (bf16 rounding of W + ΔW).

    python benchmarks/lora_merge.py                        # GPU
    python benchmarks/lora_merge.py --device cpu --layers 1 --size 64 --images 4 --n 2 --steps 4   # smoke
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
from rollout import cuda_time, peak_memory_gb, random_sd35_adapter, reset_peak_memory

from diffrl.config.schema import LoraConfig, PipelineConfig, RolloutConfig, SdeConfig
from diffrl.rollout import TrajectorySampler
from diffrl.train.lora import inject_lora, merged_adapter


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="images per sampler forward (x2 with CFG)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24, help="fewer layers for a quick CPU smoke run")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or smoke-test with --device cpu (see the docstring)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    adapter = random_sd35_adapter(args.layers, device, dtype)
    transformer = adapter.transformer
    transformer.requires_grad_(False)
    prompts = [f"prompt {i}" for i in range(args.images // args.n)]
    images = len(prompts) * args.n
    cfg = RolloutConfig(
        n=args.n,
        micro_batch_size=args.micro_batch,
        pipeline=PipelineConfig(
            height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=4.5
        ),
        sde=SdeConfig(noise_level=0.7, window_size=2, window_range=[0, args.steps // 2]),
    )
    sampler = TrajectorySampler(adapter, cfg, progress=False)

    def timed(context=nullcontext) -> tuple[float, float, torch.Tensor]:
        """(best seconds over the repeats, peak GiB, final latents) of one rollout, after a warmup."""

        def once(step: int):
            with torch.no_grad(), context():
                return sampler.sample(prompts, seed=0, step=step)

        once(0)
        reset_peak_memory()
        runs = [cuda_time(lambda r=r: once(1)) for r in range(args.repeats)]
        return min(t for _, t in runs), peak_memory_gb(), runs[0][0].samples.final_latents.float()

    results: dict = {
        "bench": "lora_merge",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": args.layers,
        "images": images,
        "size": args.size,
        "steps": args.steps,
        "fwd_batch": 2 * args.micro_batch,
        "rank": args.rank,
    }
    base_s, results["base_peak_gb"], _ = timed()
    targets = inject_lora(adapter, LoraConfig(rank=args.rank, alpha=2 * args.rank), ["default", "old"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero adapters (B starts at zero), the size of a trained update
        for name, p in transformer.named_parameters():
            if ".lora_B." in name:
                p.copy_(1e-3 * torch.randn(p.shape, generator=g))
    transformer.requires_grad_(False)
    results["lora_targets"] = targets
    lora_s, results["lora_peak_gb"], unmerged = timed()
    merged_s, results["merged_peak_gb"], merged = timed(lambda: merged_adapter(adapter, "default"))

    def merge_and_restore() -> None:
        with merged_adapter(adapter, "old"):
            pass

    _, results["merge_s"] = cuda_time(merge_and_restore)
    results["base_images_per_s"] = images / base_s
    results["lora_images_per_s"] = images / lora_s
    results["merged_images_per_s"] = images / merged_s
    results["merged_speedup"] = lora_s / merged_s
    results["final_latents_rel_diff"] = float((merged - unmerged).norm() / unmerged.norm())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
