"""The SD3.5-Medium blocks' linear layers at the Flow-GRPO recipe's shapes, bf16 against float8: torchao's
training linear (`diffrl.train.fp8_linear`, rowwise and tensorwise recipes) and the frozen-weight
linear that casts its weight once (`diffrl.train.fp8_frozen`): one JSON line.

Which layers gain is a question of shape: rowwise float8 casts the input and the weight on every
call, and torchao's own size filter (`_auto_filter_for_recipe("rowwise")`, measured on H100) would
skip every layer with N <= 2048 outputs, i.e. all of SD3.5-M's 1536-wide projections. This times
each (M, K, N) the recipe runs, compiled as the blocks are (`model.compile`), so that the
end-to-end numbers of `e2e_recipe.py --set model.fp8=...` can be read per layer:

    fwd        the sampler's and the reference pass's GEMM (no grad)
    fwd_bwd    the update's: forward, then backward to the input only (the base weight is frozen)

M: the recipe's rows, 8 prompts' samples with CFG = 16 sequences of 1024 image tokens (512²) or
205 text tokens (77 + 128). Per shape: milliseconds, TFLOP/s and fp8's speed-up over bf16.

    python benchmarks/fp8_gemms.py                 # on a GPU
    python benchmarks/fp8_gemms.py --device cpu --small --iters 2 --modes frozen_rowwise  # CPU smoke (eager)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# (name, rows M, in K, out N) of SD3.5-Medium's block linears at the recipe's batch
IMAGE, TEXT = 16 * 1024, 16 * 205
SHAPES = [
    ("attn.to_qkv/out (image)", IMAGE, 1536, 1536),
    ("ff up (image)", IMAGE, 1536, 6144),
    ("ff down (image)", IMAGE, 6144, 1536),
    ("attn.add_qkv/out (text)", TEXT, 1536, 1536),
    ("ff_context up (text)", TEXT, 1536, 6144),
    ("ff_context down (text)", TEXT, 6144, 1536),
]
# FLUX.1-dev's (3072 wide, MLP 12288) at the same rows: where a wider model's GEMMs stand
WIDE = [
    ("flux attn (image)", IMAGE, 3072, 3072),
    ("flux ff up (image)", IMAGE, 3072, 12288),
    ("flux ff down (image)", IMAGE, 12288, 3072),
]
SMALL = [("small", 256, 64, 128)]
MODES = ("torchao_rowwise", "torchao_tensorwise", "frozen_rowwise", "frozen_tensorwise")


def timed(fn, iters: int, device: torch.device) -> float:
    """Seconds per call after two warm-up calls (compilation)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def modules(k: int, n: int, device: torch.device, names: list[str]) -> dict[str, torch.nn.Module]:
    """One frozen bf16 linear and its float8 forms (the same weight): torchao's training linear
    (`model.fp8` today, rowwise or tensorwise recipe) and `FrozenFloat8Linear` (cast once)."""
    from diffrl.train.fp8_frozen import FrozenFloat8Linear

    linear = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16).requires_grad_(False)
    made: dict[str, torch.nn.Module] = {"bf16": linear}
    for name in names:
        kind, recipe = name.rsplit("_", 1)
        if kind == "torchao":
            from torchao.float8 import Float8LinearConfig

            from diffrl.train.fp8_linear import to_float8

            copy = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
            copy.load_state_dict(linear.state_dict())
            made[name] = to_float8(copy, Float8LinearConfig.from_recipe_name(recipe), enabled=True)
            made[name].requires_grad_(False)
        else:
            made[name] = FrozenFloat8Linear.from_linear(linear, recipe)
    return made


def bench_shape(m: int, k: int, n: int, args, device: torch.device) -> dict:
    made = modules(k, n, device, args.modes)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = made["bf16"](x).float()
    out: dict = {"M": m, "K": k, "N": n}
    for label, module in made.items():
        run = torch.compile(module, dynamic=False) if args.compile else module

        def fwd(run=run):
            with torch.no_grad():
                return run(x)

        def fwd_bwd(run=run):
            xin = x.detach().requires_grad_(True)
            run(xin).backward(grad)
            return xin.grad

        for kind, fn, flops in (("fwd", fwd, 2 * m * k * n), ("fwd_bwd", fwd_bwd, 4 * m * k * n)):
            seconds = timed(fn, args.iters, device)
            out[f"{label}_{kind}_ms"] = round(seconds * 1e3, 4)
            out[f"{label}_{kind}_tflops"] = round(flops / seconds / 1e12, 2)
            if label != "bf16":
                out[f"{label}_{kind}_speedup"] = round(out[f"bf16_{kind}_ms"] / out[f"{label}_{kind}_ms"], 3)
        if label != "bf16":
            with torch.no_grad():
                err = (module(x).float() - ref).norm() / ref.norm()
            out[f"{label}_rel_error"] = round(err.item(), 5)
    return out


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="one small shape (a CPU smoke run)")
    parser.add_argument("--wide", action="store_true", help="also FLUX.1-dev's 3072-wide shapes")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager modules")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="float8 forms to time against bf16 (torchao_*: the training linear; frozen_*: cast once)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        args.compile = False  # compiled float8 needs the GPU's kernels
    if any(mode.startswith("torchao") for mode in args.modes):
        from diffrl.train.fp8_linear import apply_inductor_workaround

        apply_inductor_workaround()
    shapes = SMALL if args.small else SHAPES + (WIDE if args.wide else [])
    results = {name: bench_shape(m, k, n, args, device) for name, m, k, n in shapes}
    print(
        json.dumps(
            {
                "bench": "fp8_gemms",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "torchao": _version("torchao"),
                "compiled": args.compile,
                "shapes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
