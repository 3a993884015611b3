"""What each offload option costs and saves: one Flow-GRPO training step of an SD3.5-Medium-sized
transformer, fully fine-tuned (LoRA rank 0, so the AdamW state is twice the weights), with

    none                no offload
    optimizer_offload   actor.optimizer_offload: AdamW state in host memory outside optimizer.step()
    activation_offload  actor.activation_offload: saved activations in pinned host memory (save_on_cpu)
    param_offload       actor.param_offload: FSDP2's CPUOffloadPolicy on a 1-rank group (CUDA only)

Random weights (real diffusers classes, as benchmarks/rollout.py), bf16, 512², a window of 2 SDE
steps, CFG 4.5 recomputed in training. Each mode runs in its own process (a fresh CUDA allocator):
sample a rollout (not timed), then time the actor update (forward + backward over every micro-batch
and window step, then the optimizer step). Per mode: seconds per step, the training peak
(max_memory_allocated during the step) and what stays allocated between steps (while the colocated
sampler runs: the memory the offload gives back), plus the loss and grad norm of the first step,
which must agree across the modes.

    python benchmarks/offload.py                                       # 1 GPU, all modes
    python benchmarks/offload.py --gradient-checkpointing
    python benchmarks/offload.py --layers 1 --device cpu --size 64     # CPU smoke test

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import random_sd35_adapter, update_batch

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
)
from diffrl.train.engine import TrainEngine

MODES = ("none", "optimizer_offload", "activation_offload", "param_offload")
# A child process's wall-clock limit: building, sampling and 1 + repeats steps of a 24-layer model.
CHILD_TIMEOUT_S = 900


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: build, sample, time the update; returns its measurements."""
    mode = args.mode
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if mode == "param_offload":
        if not cuda:
            return {"mode": mode, "skipped": "FSDP2's CPUOffloadPolicy needs CUDA"}
        from diffrl.train.distributed import init_distributed

        with socket.socket() as s:  # a 1-rank group on loopback: FSDP2 needs a process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        init_distributed("nccl")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    adapter = random_sd35_adapter(args.layers, device, dtype)
    trained = update_batch(adapter, args)
    rollout = trained.rollout
    micro_batches = [
        trained.select(slice(s, s + args.micro_batch)) for s in range(0, len(rollout), args.micro_batch)
    ]

    engine = TrainEngine(
        adapter,
        ModelConfig(
            dtype="bfloat16" if cuda else "float32",
            lora=LoraConfig(rank=0),
            gradient_checkpointing=args.gradient_checkpointing,
        ),
        ActorConfig(
            strategy="fsdp2" if mode == "param_offload" else "none",
            mini_batch_size=len(rollout),
            micro_batch_size=args.micro_batch,
            param_offload=mode == "param_offload",
            optimizer_offload=mode == "optimizer_offload",
            activation_offload=mode == "activation_offload",
            optim=OptimConfig(lr=1e-5),
            loss=LossConfig(clip_ratio=1e-4),
        ),
        total_optim_steps=100,
    )
    if args.compile:
        adapter.compile_blocks()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = engine.forward_backward(micro_batches)
        metrics.update(engine.optim_step())
        sync()
        return metrics, time.perf_counter() - start

    first, warmup_s = step()  # the first step also creates the AdamW state
    runs = [step() for _ in range(args.repeats)]
    sync()
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in engine.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    param_bytes = sum(p.numel() * p.element_size() for p in engine.params)
    out = {
        "mode": mode,
        "loss_first_step": first["loss"],
        "grad_norm_first_step": first["grad_norm"],
        "warmup_s": warmup_s,
        "seconds_per_step": min(t for _, t in runs),
        "trained_params_gb": gib(param_bytes),
        "adamw_state_gb": gib(state_bytes),
    }
    if cuda:
        out["peak_train_gb"] = gib(max(torch.cuda.max_memory_allocated(), 0))
        out["between_steps_gb"] = gib(torch.cuda.memory_allocated())
    if torch.distributed.is_initialized():
        from diffrl.train.distributed import shutdown_distributed

        shutdown_distributed()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: one mode
    parser.add_argument("--images", type=int, default=16, help="trajectories per step")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4, help="trajectories per forward")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or smoke-test with --layers 1 --device cpu --size 64")
    if args.mode is not None:
        print(json.dumps(run_mode(args)))
        return

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    passed = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(args).items()
        if name not in ("modes", "mode", "compile", "gradient_checkpointing")
    ]
    passed += ["--compile"] * args.compile + ["--gradient-checkpointing"] * args.gradient_checkpointing
    results = []
    for mode in modes:
        child = subprocess.run(
            [sys.executable, __file__, *passed, f"--mode={mode}"],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
        if child.returncode != 0:
            results.append({"mode": mode, "error": child.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(
        json.dumps(
            {
                "bench": "offload",
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "layers": args.layers,
                "size": args.size,
                "images_per_step": args.images,
                "micro_batch": args.micro_batch,
                "window": args.window,
                "lora_rank": 0,
                "compiled": args.compile,
                "gradient_checkpointing": args.gradient_checkpointing,
                "modes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
