"""Weight-sync time from a trainer process to a rollout replica: SD3.5-Medium-sized transformer, bf16.

Two processes (rank 0 = the trainer's sender, rank 1 = a replica) each build the SD3.5-Medium
transformer (the real diffusers class, random weights, different seeds on each side) with a LoRA
adapter on diffrl's default SD3 targets (peft, r=32, alpha=64), join a `WeightSyncGroup` and time
(a) the LoRA adapter tensors only, what moves after every LoRA step, and (b) the full base weights,
what full fine-tuning moves. On one GPU both processes share cuda:0 and the group uses gloo (NCCL
cannot put two ranks on one device), so the bytes go device -> pinned host -> loopback -> pinned
host -> device. After the last repeat of each case the replica's tensors are compared with the
trainer's (per-tensor byte sums) so a sync that moved nothing cannot pass. Prints one JSON line.

    python benchmarks/weight_sync.py                          # GPU, both ranks on cuda:0, gloo
    python benchmarks/weight_sync.py --device cpu --tiny      # CPU smoke run (seconds)
    python benchmarks/weight_sync.py --backend nccl           # two GPUs: rank r on cuda:r
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).parent))
from rollout import transformer_config

from diffrl.models.sd3 import SD3Adapter
from diffrl.train.export import adapter_key_predicate
from diffrl.workers.sync_rendezvous import free_address
from diffrl.workers.weight_specs import tensor_specs
from diffrl.workers.weight_sync import WeightSyncGroup

# A small SD3 transformer with the same structure (joint and dual-attention blocks) for CPU runs.
TINY = dict(
    sample_size=16,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=64,
    pooled_projection_dim=64,
    out_channels=16,
    pos_embed_max_size=32,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)


def build(args, device: torch.device, seed: int) -> torch.nn.Module:
    """The transformer in bf16 on `device`, allocated without a CPU copy (meta, then to_empty),
    plus the LoRA adapter, every tensor filled from a generator seeded by `seed`."""
    config = TINY if args.tiny else transformer_config(args.layers)
    diffusers_logging.set_verbosity_error()  # its note on casting with .to() is about from_pretrained
    with torch.device("meta"):
        # Every floating tensor in bf16, buffers included, as a bf16 checkpoint loads (pos_embed too).
        model = SD3Transformer2DModel(**config).to(torch.bfloat16)
    model.to_empty(device=device)
    model.add_adapter(
        LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=list(SD3Adapter.default_lora_target_modules),
        )
    )
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=gen)
            else:
                tensor.zero_()
    return model


def fingerprint(tensors: dict[str, torch.Tensor]) -> list[int]:
    """One integer per tensor: the sum of its bytes (cheap on the device, catches a missed copy)."""
    return [int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for t in tensors.values()]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, args, host: str, port: int, ready, out) -> None:
    try:
        if args.device == "cpu":
            device = torch.device("cpu")
        else:
            index = rank if args.backend == "nccl" else 0
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        model = build(args, device, seed=rank + 1)
        sync_device(device)
        base_memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        ready.wait(timeout=args.timeout_s)
        group = WeightSyncGroup.join(host, port, rank, 2, backend=args.backend, timeout_s=args.timeout_s)
        bucket_bytes = args.bucket_mb << 20
        results = {}
        is_adapter = adapter_key_predicate(model)  # the test the trainer's adapter-only sync uses
        for case, keep in (("lora", is_adapter), ("full", lambda key: not is_adapter(key))):
            params = {key: t for key, t in model.state_dict().items() if keep(key)}
            specs = tensor_specs(params.items())
            seconds, stats = [], None
            for _ in range(args.repeats):
                sync_device(device)
                start = time.perf_counter()
                if rank == 0:
                    # A generator, as the trainer's iter_weights is: the sender never sees a list.
                    stream = ((key, t) for key, t in model.state_dict().items() if keep(key))
                    stats = group.send(stream, bucket_bytes=bucket_bytes)
                else:
                    stats = group.receive(specs, params, bucket_bytes=bucket_bytes)
                sync_device(device)
                seconds.append(time.perf_counter() - start)
            results[case] = {
                "tensors": stats.tensors,
                "bytes": stats.bytes,
                "buckets": stats.buckets,
                "seconds": [round(s, 4) for s in seconds],
                "fingerprint": fingerprint(params),
            }
        if device.type == "cuda":
            results["peak_extra_gib"] = round(
                (torch.cuda.max_memory_allocated(device) - base_memory) / 2**30, 3
            )
        group.close()
        out.put((rank, results))
    except Exception as err:
        out.put((rank, {"error": f"{type(err).__name__}: {err}"}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--tiny", action="store_true", help="a small SD3 transformer (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=24, help="transformer layers of the full-size config")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of every wait in the group")
    args = parser.parse_args()
    if args.device == "cpu" and args.backend == "nccl":
        parser.error("--backend nccl needs --device cuda")

    host, port = free_address()
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Barrier(2)
    procs = [
        ctx.Process(target=worker, args=(rank, args, host, port, ready, out), daemon=True) for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    results = {}
    deadline = time.monotonic() + args.timeout_s * (2 * args.repeats + 3)
    try:
        while len(results) < 2:
            rank, result = out.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = result
    except queue.Empty:
        sys.exit(
            f"weight_sync benchmark: no result from ranks {sorted({0, 1} - set(results))} before the deadline"
        )
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for rank in (0, 1):
        if "error" in results[rank]:
            sys.exit(f"weight_sync benchmark: rank {rank} failed: {results[rank]['error']}")

    sender, receiver = results[0], results[1]
    report = {
        "benchmark": "weight_sync",
        "model": "tiny SD3" if args.tiny else f"SD3.5-Medium transformer ({args.layers} layers)",
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": args.backend,
        "bucket_mb": args.bucket_mb,
        "lora_rank": args.lora_rank,
        "repeats": args.repeats,
    }
    for case in ("lora", "full"):
        s, r = sender[case], receiver[case]
        median = statistics.median(s["seconds"])
        report[case] = {
            "tensors": s["tensors"],
            "bytes": s["bytes"],
            "gb": round(s["bytes"] / 1e9, 4),
            "buckets": s["buckets"],
            "seconds": s["seconds"],
            "median_s": round(median, 4),
            "gb_per_s": round(s["bytes"] / median / 1e9, 3),
            "bitwise_equal": s["fingerprint"] == r["fingerprint"]
            and (s["bytes"], s["tensors"]) == (r["bytes"], r["tensors"]),
        }
    if args.device == "cuda":
        report["peak_extra_gib"] = {
            "sender": sender.get("peak_extra_gib"),
            "receiver": receiver.get("peak_extra_gib"),
        }
    print(json.dumps(report))
    if not (report["lora"]["bitwise_equal"] and report["full"]["bitwise_equal"]):
        sys.exit("weight_sync benchmark: the replica's tensors differ from the trainer's after the sync")


if __name__ == "__main__":
    main()
