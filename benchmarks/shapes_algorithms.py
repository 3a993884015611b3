"""Each algorithm's shapes-world preset trained at GPU scale: held-out accuracy before → after.

    python benchmarks/shapes_algorithms.py [PRESET ...] [--steps 60] [--out runs/bench] [-- key=value ...]

Runs `diffrl train PRESET` for each preset (default: every `shapes_*` RL preset plus `default`)
with the same GPU-scale overrides (32 prompts × 16 samples per step, one optimizer step per
step, validation on the held-out split with 4 samples per prompt every `--steps // 3` steps), then
prints one JSON line per run: preset, loss, steps, wall seconds, and the held-out accuracy (the
mean over categories of the shapes verifier, `val/accuracy`) before training and at the end.
Extra `key=value` overrides after `--` apply to every run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from diffrl.config import load_config
from diffrl.config.loader import preset_names
from diffrl.controller.run import train
from diffrl.telemetry.report import validation_metrics
from diffrl.telemetry.sinks import read_metrics

GPU_SCALE = [
    "data.prompts_per_step=32",
    "rollout.n=16",
    "rollout.micro_batch_size=256",
    "actor.mini_batch_size=512",
    "actor.micro_batch_size=128",
    "rollout.val.n=4",
    "trainer.loggers=[jsonl]",
]


def default_presets() -> list[str]:
    return ["default"] + [n for n in preset_names() if n.startswith("shapes_") and n != "shapes_sft"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("presets", nargs="*", help="presets to run (default: every shapes RL preset)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/bench_shapes")
    args, extra = parser.parse_known_args()
    overrides = [o for o in extra if o != "--"]
    for preset in args.presets or default_presets():
        run_overrides = [
            *GPU_SCALE,
            f"trainer.total_steps={args.steps}",
            f"trainer.test_freq={max(1, args.steps // 3)}",
            f"trainer.save_freq={args.steps}",
            f"trainer.output_dir={args.out}",
            f"trainer.run_name={preset}",
            "trainer.resume=off",
            *overrides,
        ]
        cfg = load_config(preset, run_overrides)
        start = time.perf_counter()
        run_dir = train(preset, run_overrides)
        wall = time.perf_counter() - start
        steps = read_metrics(Path(run_dir) / "metrics.jsonl")
        vals = {s: validation_metrics(m) for s, m in steps.items() if "val/rewards/mean" in m}
        first, last = min(vals), max(vals)
        print(
            json.dumps(
                {
                    "preset": preset,
                    "loss": cfg.actor.loss.mode,
                    "trainer_type": cfg.algorithm.trainer_type,
                    "steps": args.steps,
                    "images_per_step": cfg.images_per_step,
                    "wall_s": round(wall, 1),
                    "accuracy_before": round(vals[first].get("val/accuracy", float("nan")), 4),
                    "accuracy_after": round(vals[last].get("val/accuracy", float("nan")), 4),
                    "accuracy_curve": {
                        s: round(v.get("val/accuracy", float("nan")), 4) for s, v in vals.items()
                    },
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
