"""End-to-end `diffrl train` speed of two SD3.5-Medium recipes on one GPU: one JSON line.

Both recipes run through the real machinery (`diffrl.controller.run.train`: config, preflight,
in-process worker, sampler, JPEG reward, advantages, engine, checkpoint) on a random
SD3.5-Medium-sized pipeline (`random_sd35_medium.py`: real transformer and VAE, one-layer text
encoders of the real widths). Common: 512², 10 steps, CFG 4.5, noise level 0.7, LoRA r32/α64,
77 + 128 text tokens (`max_sequence_length=128`), blocks compiled, one optimizer step per step.

    flow_grpo  Flow-GRPO's SD3.5-M recipe: 9 SDE (trained) steps of 10, KL 0.04 to the
               adapter-disabled reference, rollout and actor micro-batch 8, 4 prompts × 8 samples
    lean       a window of 2 in [0, 5), no KL, rollout micro-batch 16, actor 8, 8 prompts × 8

The first `--warmup` steps (compilation) are excluded; the rest are averaged. Per phase: seconds per
image and MFU (the trainer's own `perf/mfu/<phase>`: the adapter's analytic FLOPs, a LoRA backward
counted as 1× forward, over the GPU's dense bf16 peak). `compile_s` is the first step's time minus
a measured step's. Peak memory is the worker's `perf/max_memory_allocated_gb` over the measured steps.

    python benchmarks/e2e_recipe.py                          # both recipes, builds /tmp/sd35m
    python benchmarks/e2e_recipe.py --recipe lean --steps 2
    python benchmarks/e2e_recipe.py --tiny --device cpu       # CPU smoke run on a tiny SD3
    python benchmarks/e2e_recipe.py --set model.compile=false # any extra override, both recipes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_metrics import summarise_run  # noqa: E402

YAML = HERE / "sd35_medium_jpeg.yaml"

COMMON = [
    "model.dtype=bfloat16",
    "model.compile=true",
    "model.lora.rank=32",
    "model.lora.alpha=64",
    "rollout.n=8",
    "rollout.pipeline.height=512",
    "rollout.pipeline.width=512",
    "rollout.pipeline.num_inference_steps=10",
    "rollout.pipeline.guidance_scale=4.5",
    "rollout.pipeline.max_sequence_length=128",
    "rollout.sde.noise_level=0.7",
    "actor.strategy=none",
    "actor.micro_batch_size=8",
    "actor.loss.clip_ratio=1e-4",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
]
RECIPES = {
    "flow_grpo": [
        "rollout.micro_batch_size=8",
        "rollout.sde.window_size=9",
        "rollout.sde.window_range=null",
        "actor.loss.kl_coef=0.04",
        "data.prompts_per_step=4",
        "actor.mini_batch_size=32",
    ],
    "lean": [
        "rollout.micro_batch_size=16",
        "rollout.sde.window_size=2",
        "rollout.sde.window_range=[0,5]",
        "actor.loss.kl_coef=0",
        "data.prompts_per_step=8",
        "actor.mini_batch_size=64",
    ],
}
# The tiny CPU smoke run: the same recipes at a size a laptop runs in seconds.
TINY = [
    "model.dtype=float32",
    "rollout.pipeline.height=64",
    "rollout.pipeline.width=64",
    "rollout.pipeline.max_sequence_length=16",
]


def build_model(path: Path, tiny: bool, device: str) -> None:
    """A random pipeline at `path` unless one is there: SD3.5-M-sized, or diffrl's tiny SD3."""
    if (path / "model_index.json").exists():
        return
    if tiny:
        from diffrl.models.sd3 import build_tiny

        build_tiny(path)
        return
    sys.path.insert(0, str(HERE))
    import random_sd35_medium

    # Random initialisation of 2.5 B parameters is minutes on a CPU and seconds on the GPU.
    argv, sys.argv = sys.argv, ["random_sd35_medium.py", str(path)]
    try:
        with torch.device(device):
            random_sd35_medium.main()
    finally:
        sys.argv = argv


def run_recipe(name: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    from diffrl.controller.run import train

    total = args.warmup + args.steps
    overrides = [
        f"model.path={model}",
        *COMMON,
        *RECIPES[name],
        *(TINY if args.tiny else []),
        f"trainer.total_steps={total}",
        f"trainer.output_dir={out}",
        f"trainer.run_name={name}",
        *args.set,
    ]
    start = time.perf_counter()
    run_dir = train(str(YAML), overrides)
    wall = time.perf_counter() - start
    return {**summarise_run(run_dir, args.warmup), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", choices=[*RECIPES, "both"], default="both")
    parser.add_argument("--model", type=Path, default=None, help="pipeline directory (built if absent)")
    parser.add_argument("--tiny", action="store_true", help="diffrl's tiny SD3 at 64² (CPU smoke run)")
    parser.add_argument("--device", default="cuda", help="where the random model is initialised")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded (compilation)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every recipe")
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="e2e_recipe_"))
    model = args.model or (out / "tiny_sd3" if args.tiny else Path("/tmp/sd35m"))
    build_model(model, args.tiny, args.device)
    if args.recipe == "both":
        # Each recipe in its own process: compiled graphs, dynamo's caches and the CUDA allocator
        # of one recipe must not carry over into the other's numbers.
        results = {}
        for name in RECIPES:
            argv = [a for a in sys.argv[1:] if a not in ("both",)]
            cmd = [
                sys.executable,
                __file__,
                *argv,
                "--recipe",
                name,
                "--model",
                str(model),
                "--out",
                str(out),
            ]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])[name]
    else:
        results = {args.recipe: run_recipe(args.recipe, model, out, args)}
    cuda = torch.cuda.is_available()
    print(
        json.dumps(
            {
                "bench": "e2e_recipe",
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "warmup_steps": args.warmup,
                "measured_steps": args.steps,
                "overrides": args.set,
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
