"""A family preset's recipe on one GPU, on a full-size random pipeline: one JSON line.

Runs `diffrl.controller.run.train` (the real machinery: config, preflight, worker, sampler,
reward, advantages, engine) with the preset's recipe (resolution, frames, steps, guidance, SDE
window, LoRA, loss, micro-batches, compile) and these changes, all listed in the JSON's
`overrides`:

- one GPU: `actor.strategy=none`, `trainer.n_gpus_per_node=1`. The batch is the preset's share of
  one GPU: `data.prompts_per_step` and `actor.mini_batch_size` divided by the preset's GPU count
  (so each optimizer step sees what one of the preset's GPUs sees); `--global-batch` keeps the
  preset's whole batch instead. `--gpus N` runs N colocated GPUs, each with that share (the
  batch × N), `actor.strategy` the run's own choice: its images/s/GPU over `--gpus 1`'s is the
  per-GPU efficiency;
- the model: a random pipeline of the family's real architecture (`random_pipelines.py`), built
  under /tmp if absent;
- the reward: `jpeg_compressibility` (needs no external model) instead of the preset's
  PickScore / OCR / CLIP, on one CPU reward worker, on the same video frames as the preset's
  reward. The reward's own cost is then not measured;
- data: the built-in `simple_prompts.txt`; for an edit family (FLUX.1 Kontext, Qwen-Image-Edit),
  whose prompts need condition images, a generated `edit_prompts/prompts.jsonl` in the output
  directory: `EDIT_ROWS` edit instructions, each with its own generated picture at the run's
  resolution (`random_pipelines.condition_image`). No checkpoints, no validation.

The first `--warmup` steps (compilation) are excluded, the rest averaged (`run_metrics.py`). A
"sample" (`images_per_*`, `per_image_s`) is one trajectory: an image, or a video for Wan.

    python benchmarks/family_presets.py --family flux_dev                 # FLUX.1-dev LoRA, 3 steps
    python benchmarks/family_presets.py --family qwen_image --preset all  # the 3 Qwen-Image presets
    python benchmarks/family_presets.py --family qwen_image --gpus 2      # 2 GPUs, each one GPU's share
    python benchmarks/family_presets.py --family flux_kontext            # FLUX.1 Kontext LoRA (edit)
    python benchmarks/family_presets.py --family qwen_image_edit         # Qwen-Image-Edit LoRA (edit)
    python benchmarks/family_presets.py --family flux2_klein_4b          # FLUX.2 [klein] 4B LoRA
    python benchmarks/family_presets.py --family flux2_dev --gpus 4      # FLUX.2 [dev] 32B, 4 GPUs
    python benchmarks/family_presets.py --family wan21_1_3b --layers 1 --device cpu \\
        --set rollout.pipeline.height=64 rollout.pipeline.width=64 ...    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_metrics import profile_summary, summarise_run  # noqa: E402

#: family -> (its random pipeline, its presets: the first is the default)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "flux_dev": ("flux_dev", ("flux_dev_lora",)),
    "qwen_image": ("qwen_image", ("qwen_image_ocr", "qwen_image_dpo", "qwen_image_flow_dppo")),
    "wan21_1_3b": ("wan21_1_3b", ("wan21_t2v_1_3b_lora", "wan21_t2v_1_3b_video")),
    "wan22_a14b": ("wan22_a14b", ("wan22_t2v_a14b_lora",)),
    "flux_kontext": ("flux_kontext", ("flux_kontext_lora",)),
    "qwen_image_edit": ("qwen_image_edit", ("qwen_image_edit_lora",)),
    # The 2026 families (issue 49): their random pipelines carry full-size text encoders.
    "flux2_klein_4b": ("flux2_klein_4b", ("flux2_klein_lora",)),
    "flux2_klein_9b": ("flux2_klein_9b", ("flux2_klein_lora",)),
    "flux2_dev": ("flux2_dev", ("flux2_dev_lora",)),
    "zimage_turbo": ("zimage_turbo", ("zimage_turbo_lora",)),
    "qwen_image21": ("qwen_image21", ("qwen_image21_lora",)),
}
REWARD = "jpeg_compressibility"
PROMPTS = "builtin:simple_prompts.txt"
MODELS_DIR = Path("/tmp/diffrl_random")
#: Rows of an edit family's generated prompt file (the sampler wraps round them for larger batches).
EDIT_ROWS = 8
EDIT_INSTRUCTIONS = (
    "make the sky orange",
    "add a red hat",
    "turn it into a pencil sketch",
    "put a small boat on the left",
    "make it night time",
    "add the text hello in white letters",
    "replace the background with a forest",
    "make the colours warmer",
)


def default_model_dir(family: str, layers: int | None) -> Path:
    pipeline = FAMILIES[family][0]
    return MODELS_DIR / (pipeline if layers is None else f"{pipeline}-layers{layers}")


def build_model(family: str, path: Path, layers: int | None, device: str) -> None:
    """The family's random pipeline at `path` unless one is there."""
    if (path / "model_index.json").exists():
        print(f"using the pipeline at {path}", file=sys.stderr, flush=True)
        return
    import random_pipelines

    # Its progress goes to stderr: stdout carries only this script's JSON line.
    argv = [FAMILIES[family][0], str(path), "--device", device]
    if layers is not None:
        argv += ["--layers", str(layers)]
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        random_pipelines.main(argv)
    finally:
        sys.stdout = stdout
    # The built pipeline (up to ~35 GB on the GPU with a full-size text encoder) is garbage once
    # written, but pipelines hold reference cycles: free it before the run loads its own copy.
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def edit_prompt_file(folder: Path, width: int, height: int, rows: int = EDIT_ROWS) -> Path:
    """Write `rows` edit prompts with condition images to `folder` (docs/data.md, "Condition images":
    .jsonl rows {"prompt": ..., "image": <path relative to the file>}): one generated picture of
    `width` x `height` per row, all of one size as a run's batches need. Returns the .jsonl file."""
    import random_pipelines

    images = Path(folder) / "images"
    images.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        random_pipelines.condition_image(width, height, seed=i).save(images / f"{i}.png")
        prompt = EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]
        lines.append(json.dumps({"prompt": prompt, "image": f"images/{i}.png"}))
    path = Path(folder) / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def prompts_for(model: Path, preset: str, out: Path, overrides: Sequence[str] = ()) -> str:
    """The prompt file a run on `model` reads: the built-in prompts, or for an edit model a generated
    file of prompts with condition images (`edit_prompt_file`) under `out`, at the resolution of
    `preset` with the run's `overrides` (all of them: the config they make must be valid)."""
    from diffrl.config.loader import load_config
    from diffrl.models import edits_images

    if not edits_images(model):
        return PROMPTS
    pipeline = load_config(preset, list(overrides)).rollout.pipeline
    folder = Path(out) / "edit_prompts" / f"{pipeline.width}x{pipeline.height}"
    if (folder / "prompts.jsonl").exists():
        return str(folder / "prompts.jsonl")
    return str(edit_prompt_file(folder, pipeline.width, pipeline.height))


def one_gpu_overrides(
    preset: str, global_batch: bool, gpus_here: int = 1, prompt_file: str = PROMPTS
) -> list[str]:
    """The changes that run `preset` on one GPU with a reward that needs no model (module docstring);
    with `gpus_here` > 1, on that many GPUs colocated, each with one GPU's share of the batch and
    `actor.strategy` left to the run (`auto`). `prompt_file`: the prompts (`prompts_for`)."""
    from diffrl.config.loader import load_config

    cfg = load_config(preset)
    gpus = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    prompts, mini = cfg.data.prompts_per_step, cfg.actor.mini_batch_size
    if not global_batch:
        if prompts % gpus or mini % gpus:
            raise ValueError(
                f"{preset}: data.prompts_per_step={prompts} or actor.mini_batch_size={mini} does not "
                f"split over its {gpus} GPUs; pass --global-batch or set them with --set"
            )
        prompts, mini = prompts // gpus, mini // gpus
    # Video presets score a few frames per video; the stand-in reward scores the same frames.
    frames = {fn.video_frames for fn in cfg.reward.functions.values()} - {None}
    video_frames = f", video_frames: {min(frames)}" if frames else ""
    return [
        # several GPUs: the run's own choice, also where the preset names one for its own GPU count
        f"actor.strategy={'none' if gpus_here == 1 else 'auto'}",
        f"trainer.n_gpus_per_node={gpus_here}",
        "trainer.nnodes=1",
        f"data.prompts_per_step={prompts * gpus_here}",
        f"actor.mini_batch_size={mini * gpus_here}",
        f"reward.functions=!replace {{{REWARD}: {{weight: 1.0{video_frames}}}}}",
        "reward.workers=1",
        "reward.gpus_per_worker=0",
        f"data.train_files=[{prompt_file}]",
        "data.val_files=[]",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
    ]


def run_preset(preset: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    from diffrl.config.loader import load_config
    from diffrl.controller.run import train

    # --profile: one more step, under the profiler, left out of the averages
    total = args.steps + (1 if args.profile else 0)

    def run_overrides(prompt_file: str) -> list[str]:
        return [
            f"model.path={model}",
            *one_gpu_overrides(preset, args.global_batch, args.gpus, prompt_file),
            f"trainer.total_steps={total}",
            *([f"trainer.profile_steps=[{total}]"] if args.profile else []),
            f"trainer.output_dir={out}",
            f"trainer.run_name={preset}",
            *args.set,
        ]

    overrides = run_overrides(prompts_for(model, preset, out, run_overrides(PROMPTS)))
    cfg = load_config(preset, overrides)
    start = time.perf_counter()
    run_dir = train(preset, overrides)
    wall = time.perf_counter() - start
    return {
        "preset": preset,
        "sample_kind": "video" if cfg.rollout.pipeline.num_frames > 1 else "image",
        "samples_per_step": cfg.images_per_step,
        "resolution": [
            cfg.rollout.pipeline.height,
            cfg.rollout.pipeline.width,
            cfg.rollout.pipeline.num_frames,
        ],
        **summarise_run(run_dir, args.warmup, args.steps - args.warmup),
        **({"profile": profile_summary(run_dir, total)} if args.profile else {}),
        "wall_s": wall,
        "overrides": overrides,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=list(FAMILIES), required=True)
    parser.add_argument(
        "--preset", default=None, help="one of the family's presets, or 'all' (default: the first)"
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps, warm-up included")
    parser.add_argument(
        "--warmup", type=int, default=1, help="steps excluded from the averages (compilation)"
    )
    parser.add_argument("--model", type=Path, default=None, help="pipeline directory (built if absent)")
    parser.add_argument("--layers", type=int, default=None, help="build with fewer blocks (CPU smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--global-batch", action="store_true", help="keep the preset's whole batch on one GPU"
    )
    parser.add_argument(
        "--gpus", type=int, default=1, help="colocated GPUs, each with one GPU's share (scaling)"
    )
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temp dir)")
    parser.add_argument(
        "--remove-model", action="store_true", help="delete the pipeline directory at the end"
    )
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides, applied last")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run one more step under torch.profiler (trainer.profile_steps), left out of the "
        "averages: the trainer's per-call summary in the JSON, the trace in the run directory",
    )
    parser.add_argument("--verbose", action="store_true", help="the libraries' own logs and progress bars")
    args = parser.parse_args()
    from diffrl.models import edits_images
    from diffrl.telemetry.console import configure

    configure(verbose=args.verbose)  # quiet workers, as `diffrl train` has them

    presets = FAMILIES[args.family][1]
    preset = args.preset or presets[0]
    if preset != "all" and preset not in presets:
        parser.error(
            f"--preset {preset!r} is not a {args.family} preset; choose from {', '.join(presets)} or all"
        )
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: nothing would be measured")
    out = args.out or Path(tempfile.mkdtemp(prefix="family_presets_"))
    model = args.model or default_model_dir(args.family, args.layers)
    build_model(args.family, model, args.layers, args.device)
    data = (
        f"{EDIT_ROWS} generated edit rows with images (edit_prompt_file)" if edits_images(model) else PROMPTS
    )
    try:
        if preset == "all":
            # Each preset in its own process: compiled graphs, dynamo's caches and the CUDA
            # allocator of one preset must not carry over into the next one's numbers.
            results = {}
            for name in presets:
                cmd = [sys.executable, __file__, "--family", args.family, "--preset", name]
                cmd += ["--model", str(model), "--out", str(out), "--device", args.device]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--gpus", str(args.gpus)]
                cmd += ["--global-batch"] if args.global_batch else []
                cmd += ["--set", *args.set] if args.set else []
                cmd += ["--verbose"] if args.verbose else []
                cmd += ["--profile"] if args.profile else []
                done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
                results[name] = json.loads(done.stdout.strip().splitlines()[-1])["results"][name]
        else:
            results = {preset: run_preset(preset, model, out, args)}
    finally:
        if args.remove_model:
            shutil.rmtree(model, ignore_errors=True)
    cuda = torch.cuda.is_available()
    print(
        json.dumps(
            {
                "bench": "family_presets",
                "family": args.family,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "model": str(model),
                "model_layers": args.layers,
                "reward": f"{REWARD} (stands in for the preset's reward: it needs no external model)",
                "data": data,
                "batch": "the preset's whole batch" if args.global_batch else "the preset's per-GPU share",
                "gpus": args.gpus,
                "warmup_steps": args.warmup,
                "measured_steps": args.steps - args.warmup,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
