"""End-to-end `diffrl train` speed of two SD3.5-Medium recipes on one or more GPUs: one JSON line.

Both recipes run through the real machinery (`diffrl.controller.run.train`: config, preflight,
in-process worker, sampler, JPEG reward, advantages, engine, checkpoint) on a random
SD3.5-Medium-sized pipeline (`random_sd35_medium.py`: real transformer and VAE, one-layer text
encoders of the real widths). Common: 512², 10 steps, CFG 4.5, noise level 0.7, LoRA r32/α64,
77 + 128 text tokens (`max_sequence_length=128`), blocks compiled, one optimizer step per step.

    flow_grpo  Flow-GRPO's SD3.5-M recipe: 9 SDE (trained) steps of 10, KL 0.04 to the
               adapter-disabled reference, rollout and actor micro-batch 8, 4 prompts × 8 samples
    lean       a window of 2 in [0, 5), no KL, rollout micro-batch 16, actor 8, 8 prompts × 8

With `--gpus 1 2 4` each recipe runs once per GPU count, colocated, with the same per-GPU batch
(prompts per step and mini-batch × N: one optimizer step per step either way), and `scaling`
gives each count's images/s over the smallest count's. `--splits 1+1 3+1` adds separate-placement
runs (`T+R`: T trainer ranks, R rollout replicas, one step off unless `--set` says otherwise) with
the same per-GPU batch over all T + R GPUs, so their images/s compare with `--gpus T+R`. `actor.strategy` is the run's own choice
(`auto`) unless `--set actor.strategy=...` names one.

The first `--warmup` steps (compilation) are excluded; the rest are averaged. Per phase: seconds per
image and MFU (the trainer's own `perf/mfu/<phase>`: the adapter's analytic FLOPs, a LoRA backward
counted as 1× forward, over the GPU's dense bf16 peak). `compile_s` is the first step's time minus
a measured step's. Peak memory is the worker's `perf/max_memory_allocated_gb` over the measured steps.

    python benchmarks/e2e_recipe.py                          # both recipes, builds /tmp/sd35m
    python benchmarks/e2e_recipe.py --recipe lean --steps 2
    python benchmarks/e2e_recipe.py --tiny --device cpu       # CPU smoke run on a tiny SD3
    python benchmarks/e2e_recipe.py --set model.compile=false # any extra override, both recipes
    python benchmarks/e2e_recipe.py --gpus 1 2 4              # scaling, same per-GPU batch
    python benchmarks/e2e_recipe.py --recipe lean --gpus 2 --splits 1+1   # placements on 2 GPUs
    python benchmarks/e2e_recipe.py --recipe flow_grpo --profile   # + a profiled step (JSON "profile")
    python benchmarks/e2e_recipe.py --recipe flow_grpo --set model.fp8=all   # float8 GEMMs (torchao)

With `--set model.fp8=sampling` the old log-probs are recomputed (the sampler's float8 ones are not
the trainer's), and each run's `rollout_correction` holds the per-step log-prob gap between them;
`fp8` and `torchao` say what ran.
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
from run_metrics import profile_summary, summarise_run  # noqa: E402

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
    "actor.micro_batch_size=8",
    "actor.loss.clip_ratio=1e-4",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.check_at_start=false",  # one GPU would run it, several not: wall_s would not compare
    "trainer.loggers=[jsonl]",
]
RECIPES = {
    "flow_grpo": [
        "rollout.micro_batch_size=8",
        "rollout.sde.window_size=9",
        "rollout.sde.window_range=null",
        "actor.loss.kl_coef=0.04",
    ],
    "lean": [
        "rollout.micro_batch_size=16",
        "rollout.sde.window_size=2",
        "rollout.sde.window_range=[0,5]",
        "actor.loss.kl_coef=0",
    ],
}
# Per GPU: (prompts per step, trajectories per optimizer step); × the GPU count.
PER_GPU_BATCH = {"flow_grpo": (4, 32), "lean": (8, 64)}
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


# A separate placement's runs: one step off (what the placement is for) unless `--set` says otherwise.
SEPARATE = ["trainer.placement=separate", "trainer.async_mode=one_step_off"]


def parse_layout(text: str) -> tuple[int, int]:
    """`N` (N colocated GPUs) or `T+R` (T trainer ranks and R rollout replicas) as (T, R)."""
    trainer, _, replicas = text.partition("+")
    try:
        layout = int(trainer), int(replicas or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or T+R (e.g. 2 or 1+1)") from None
    if layout[0] < 1 or layout[1] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 trainer rank and 0 or more replicas")
    return layout


def layout_name(trainer: int, replicas: int) -> str:
    return f"{trainer}+{replicas}" if replicas else f"{trainer}gpu"


def run_recipe(name: str, layout: tuple[int, int], model: Path, out: Path, args: argparse.Namespace) -> dict:
    from diffrl.controller.run import train

    trainer, replicas = layout
    gpus = trainer + replicas
    # --profile: one more step, under the profiler, left out of the averages
    total = args.warmup + args.steps + (1 if args.profile else 0)
    prompts, mini_batch = PER_GPU_BATCH[name]
    overrides = [
        f"model.path={model}",
        *COMMON,
        *RECIPES[name],
        f"data.prompts_per_step={prompts * gpus}",
        f"actor.mini_batch_size={mini_batch * gpus}",
        f"trainer.n_gpus_per_node={trainer}",
        *([*SEPARATE, f"rollout.replicas={replicas}"] if replicas else []),
        *(TINY if args.tiny else []),
        f"trainer.total_steps={total}",
        *([f"trainer.profile_steps=[{total}]"] if args.profile else []),
        f"trainer.output_dir={out}",
        f"trainer.run_name={name}-{layout_name(trainer, replicas)}",
        *args.set,
    ]
    if args.sampler_own_batch:
        sample_at_own_batch()
    start = time.perf_counter()
    run_dir = train(str(YAML), overrides)
    wall = time.perf_counter() - start
    plan = json.loads((run_dir / "plan.json").read_text())
    strategy = plan["strategy"]  # the run plan's choice
    summary = summarise_run(run_dir, args.warmup, args.steps)
    if args.profile:
        summary["profile"] = profile_summary(run_dir, total)
        summary["kernel_share"] = kernel_share(summary)
    return {
        **summary,
        "gpus": gpus,
        "replicas": replicas,
        "strategy": strategy,
        "fp8": plan["fp8"],
        "wall_s": wall,
    }


def torchao_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def sample_at_own_batch() -> None:
    """Rule (b) of the old-log-prob comparison: the sampler computes its window steps at its own
    micro-batch through its no-grad graph (as it does when the log-probs are recomputed), while the
    trainer still takes them as its old log-probs (run with --set algorithm.old_log_probs=rollout).
    The ratio then starts off 1 by the kernels' rounding: `ratio_std` and `clipfrac` show by how
    much. A measurement of the alternative, not a mode diffrl offers: it patches this process's
    sampler (one GPU runs its worker in-process)."""
    from diffrl.rollout.sampler import TrajectorySampler

    init = TrajectorySampler.__init__

    def own_batch_init(self, *a, **kw):
        init(self, *a, **kw)
        self.log_probs_reused = False  # no trainer-sized slices, no training graph

    TrajectorySampler.__init__ = own_batch_init


# The worker calls each trainer phase is made of (diffrl.workers.roles), for `kernel_share`.
PHASE_CALLS = {
    "gen": ("sample_and_score",),
    "ref+old_log_prob": ("staged_log_probs",),
    "update_actor": ("stage", "stage_targets", "staged_forward_backward", "optim_step"),
}


def kernel_share(summary: dict) -> dict:
    """Per phase: the profiled step's GPU kernel seconds over the unprofiled steps' mean wall
    seconds. The profiler records every operator, which slows CPU-bound code, so its own
    `busy_fraction` understates how busy the GPU is in a normal step; this is the real share."""
    images = summary["images_per_step_per_gpu"]
    out = {}
    for phase, calls in PHASE_CALLS.items():
        wall = sum(summary["per_image_s"].get(p, 0.0) for p in phase.split("+")) * images
        kernels = sum(summary["profile"][c]["busy_s"] for c in calls if c in summary["profile"])
        if wall > 0 and kernels > 0:
            out[phase] = round(kernels / wall, 4)
    return out


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
    parser.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts to run (scaling)")
    parser.add_argument(
        "--splits", type=parse_layout, nargs="+", default=[], help="separate placements T+R to run"
    )
    parser.add_argument("--layout", type=parse_layout, default=None, help=argparse.SUPPRESS)  # one child run
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run one more step under torch.profiler (trainer.profile_steps): its trace in the run "
        "directory, the trainer's per-call summary in the JSON, the step left out of the averages",
    )
    parser.add_argument("--verbose", action="store_true", help="the libraries' own logs and progress bars")
    parser.add_argument(
        "--sampler-own-batch",
        action="store_true",
        help="sample the window at the rollout micro-batch without the training graph while the "
        "trainer reuses those log-probs (pair with --set algorithm.old_log_probs=rollout): the "
        "ratio's mismatch is in ratio_std and clipfrac",
    )
    args = parser.parse_args()
    from diffrl.telemetry.console import configure

    configure(verbose=args.verbose)  # quiet workers, as `diffrl train` has them
    if args.layout:
        layouts = [args.layout]
    else:
        gpus = args.gpus if args.gpus is not None else ([] if args.splits else [1])
        layouts = [(g, 0) for g in gpus] + args.splits

    out = args.out or Path(tempfile.mkdtemp(prefix="e2e_recipe_"))
    model = args.model or (out / "tiny_sd3" if args.tiny else Path("/tmp/sd35m"))
    build_model(model, args.tiny, args.device)
    names = list(RECIPES) if args.recipe == "both" else [args.recipe]
    if len(names) * len(layouts) > 1:
        # Each run in its own process: compiled graphs, dynamo's caches and the CUDA allocator of
        # one run must not carry over into another's numbers.
        results = {}
        for name in names:
            runs = {}
            for trainer, replicas in layouts:
                label = layout_name(trainer, replicas)
                cmd = [
                    sys.executable,
                    __file__,
                    *_child_args(args),
                    *("--recipe", name, "--layout", f"{trainer}+{replicas}"),
                    *("--model", str(model), "--out", str(out)),
                ]
                done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                if done.returncode:
                    # one failed layout (out of memory, say) must not lose the others' numbers
                    runs[label] = {"error": f"exit {done.returncode}", "gpus": trainer + replicas}
                else:
                    runs[label] = json.loads(done.stdout.strip().splitlines()[-1])[name]
                print(f"e2e_recipe: {name} on {label}: {runs[label]}", file=sys.stderr, flush=True)
            results[name] = _scaling(runs)
    else:
        results = {names[0]: run_recipe(names[0], layouts[0], model, out, args)}
    cuda = torch.cuda.is_available()
    print(
        json.dumps(
            {
                "bench": "e2e_recipe",
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "torchao": torchao_version(),
                "warmup_steps": args.warmup,
                "measured_steps": args.steps,
                "overrides": args.set,
                **results,
            }
        )
    )


def _child_args(args: argparse.Namespace) -> list[str]:
    """The parent's settings that every child run shares."""
    out = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--device", args.device]
    if args.tiny:
        out.append("--tiny")
    if args.verbose:
        out.append("--verbose")
    if args.profile:
        out.append("--profile")
    if args.sampler_own_batch:
        out.append("--sampler-own-batch")
    return out + (["--set", *args.set] if args.set else [])


def _scaling(runs: dict[str, dict]) -> dict:
    """Each layout's run, and its images/s (all GPUs), speedup and per-GPU efficiency over the
    first colocated layout with the fewest GPUs that finished (else the first that finished)."""
    done = {label: r for label, r in runs.items() if "error" not in r}
    if not done:
        return {"runs": runs, "scaling": {}}
    colocated = [label for label, r in done.items() if not r["replicas"]]
    base_label = min(colocated or done, key=lambda label: done[label]["gpus"])
    base = done[base_label]["images_per_s_per_gpu"]
    return {
        "runs": runs,
        "scaling": {
            label: {
                "images_per_s": r["images_per_s_per_gpu"] * r["gpus"],
                "speedup": r["images_per_s_per_gpu"] * r["gpus"] / (base * done[base_label]["gpus"]),
                "per_gpu_efficiency": r["images_per_s_per_gpu"] / base,
                "base": base_label,
            }
            for label, r in done.items()
        },
    }


if __name__ == "__main__":
    main()
