"""One Flow-GRPO training step on an SD3.5-Medium-sized transformer: time, images/s, MFU, memory.

Random weights (real diffusers classes), bf16, LoRA r32 on the SD3 recipe's targets, 512², a
window of 2 SDE steps, CFG 4.5 recomputed in training as in sampling. The rollout is sampled
first (not timed); the timed part is the actor update of the whole step: forward + backward over
every micro-batch and window step, then the optimizer step. MFU counts what the hardware must
do: a forward, plus a backward that for frozen base weights needs only the activation gradients
(≈ 1× forward; LoRA's own weight gradients are negligible), so 2× forward FLOPs.

    python benchmarks/train_step.py                                  # 1 GPU
    torchrun --nproc_per_node 2 benchmarks/train_step.py --fsdp      # FSDP2 over 2 GPUs

Prints one JSON line (rank 0). `losses` and `grad_norms` are per optimizer step on a fixed
rollout: the 1-GPU and the FSDP2 runs must agree on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import TEXT_TOKENS, random_sd35_adapter, update_batch

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
)
from diffrl.train.engine import TrainEngine

H100_BF16_DENSE_TFLOPS = 989.0


def write_profile(step, path: Path, cuda: bool) -> None:
    """One more step under torch.profiler: its kernels by total device time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=32, help="trajectories per step (global)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="trajectories per forward, per GPU")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (launch with torchrun)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
    parser.add_argument(
        "--lora-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype the LoRA weights are held and computed in (the engine keeps fp32 master weights)",
    )
    parser.add_argument("--autocast", action="store_true", help="run the step under bf16 autocast")
    parser.add_argument(
        "--profile", type=Path, default=None, help="write a torch.profiler table of one step here"
    )
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.fsdp:
        from diffrl.train.distributed import init_distributed

        init_distributed()
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else "cpu"
    )
    if device != "cpu":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    adapter = random_sd35_adapter(args.layers, device, dtype)  # identical random weights on every rank
    # The whole global step's rollout on every rank (same seed), then each rank trains its shard:
    # exactly the global batch a single GPU trains.
    trained = update_batch(adapter, args)
    rollout = trained.rollout
    per_rank = len(rollout) // world
    shard = trained.select(slice(rank * per_rank, (rank + 1) * per_rank))

    engine = TrainEngine(
        adapter,
        ModelConfig(
            dtype="bfloat16",
            lora=LoraConfig(rank=32, alpha=32),
            gradient_checkpointing=args.gradient_checkpointing,
        ),
        ActorConfig(
            strategy="fsdp2" if args.fsdp else "none",
            mini_batch_size=args.images,
            micro_batch_size=args.micro_batch,
            optim=OptimConfig(lr=1e-4),
            loss=LossConfig(clip_ratio=1e-4),
        ),
        total_optim_steps=100,
    )
    if args.lora_dtype != "float32":
        from diffusers.training_utils import cast_training_params

        cast_training_params(adapter.transformer, getattr(torch, args.lora_dtype))
    if args.compile:
        adapter.compile_blocks()
    micro_batches = [
        shard.select(slice(s, s + args.micro_batch)) for s in range(0, per_rank, args.micro_batch)
    ]

    cuda = device != "cpu"

    def step():
        with torch.autocast(device.type if cuda else "cpu", dtype=torch.bfloat16, enabled=args.autocast):
            metrics = engine.forward_backward(micro_batches)
        metrics.update(engine.optim_step())
        return metrics

    def timed():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = step()
        if cuda:
            torch.cuda.synchronize()
        return metrics, time.perf_counter() - start

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first, warmup_s = timed()
    runs = [timed() for _ in range(args.repeats)]
    seconds = min(t for _, t in runs)
    if args.profile is not None and rank == 0:
        write_profile(step, args.profile, cuda)
    forward_flops = (
        adapter.flops_per_forward(2 * per_rank, args.size, args.size, TEXT_TOKENS) * args.window
    )  # CFG pairs
    mfu = 2 * forward_flops / seconds / (args.peak_tflops * 1e12)
    if rank == 0:
        print(
            json.dumps(
                {
                    "bench": "train_step",
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "gpus": world,
                    "fsdp": args.fsdp,
                    "compiled": args.compile,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "images_per_step": len(rollout),
                    "micro_batch": args.micro_batch,
                    "window": args.window,
                    "size": args.size,
                    "lora_rank": 32,
                    "lora_dtype": args.lora_dtype,
                    "autocast": args.autocast,
                    # per optimizer step: the 1-GPU and FSDP2 runs must agree (same global batch)
                    "losses": [first["loss"]] + [m["loss"] for m, _ in runs],
                    "grad_norms": [first["grad_norm"]] + [m["grad_norm"] for m, _ in runs],
                    "warmup_s": warmup_s,
                    "seconds_per_step": seconds,
                    "images_per_s": len(rollout) / seconds,
                    "images_per_s_per_gpu": len(rollout) / seconds / world,
                    "mfu": mfu,
                    "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                }
            )
        )


if __name__ == "__main__":
    main()
