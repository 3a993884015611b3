"""Each algorithm's shapes-world preset at GPU scale: training time to a fixed accuracy, images/s/GPU.

    python benchmarks/shapes_algorithms.py [PRESET ...] [--steps 60] [--split train|heldout|both]
        [--target 0.9] [--val-every 5] [--max-minutes M] [--out runs/bench_shapes]
        [--json-out FILE] [--table] [--table-out FILE] [-- key=value ...]
    python benchmarks/shapes_algorithms.py --from-json FILE ... [--target T] [--max-minutes M]
        [--table] [--table-out FILE]

Runs `diffrl train PRESET` for each preset (default: every shapes-world algorithm preset:
each `shapes_*` preset but the supervised `shapes_sft` and `shapes_edit_sft`, `shapes_async`
(Flow-GRPO with another placement), `shapes_base` (their base, Flow-GRPO) and `shapes_edit` (another task: image editing); `default` is
`shapes_nft_cfg_free` under another name), all
with the same GPU-scale overrides: 32 prompts × 16 samples per step, one optimizer step per step, 4 validation samples per
prompt, validation before training and every `--val-every` steps. Extra `key=value` overrides after `--` apply to every run
and win over these.

`--split` picks the validation prompts: `train` (the default) validates on the preset's own
training prompts (its `data.train_files`, `builtin:shapes_train.jsonl`, the prompts the reward
trained on), so the target is a train-split accuracy; `heldout` keeps the preset's
`data.val_files` (its held-out file). Accuracy is `val/accuracy`, the mean over categories of the
shapes verifier's verdicts. `both` validates on the two splits at once, on a file written to
`--out` (`both_splits_N.jsonl`): `balanced_rows(split, N)` of each split (N = `--val-per-category`,
64 by default, rows per category; each row has validation noise of its own), each row's data
source named `<split>_<category>`, so validation logs `val/train_colors/accuracy`,
`val/heldout_colors/accuracy`, ...; the JSON line then has `split_curves`: each split's accuracy
(the mean over its six categories) per validated step, and `val/accuracy` is the mean of the two.

Time counts training only: the running sum of each step's `timing_s/step` (sampling, reward,
update), which the trainer measures apart from validation and checkpoints (`timing_s/validation`,
`timing_s/checkpoint`). diffrl has no wall-clock stop, so `--max-minutes M` cuts each run's curve
afterwards: only the steps whose running training time is within M minutes count. Pick `--steps`
large enough to fill the budget: `stopped_by` says which limit ended the counted curve.

Prints one JSON line per run (`--json-out FILE` appends it to FILE as well: `diffrl train`
prints its own lines to stdout too): preset, algorithm, loss, split, target, the first validated
step with accuracy >= target and the training seconds up to it (`steps_to_target`,
`train_s_to_target`; null when never reached), images/s/GPU (`throughput/images_per_s_per_gpu`,
mean over the steps after the first, which carries compilation and warm-up), the best accuracy
and its step, and `accuracy_curve`: each validated step with its training seconds. `--table`
prints a Markdown table of the runs to stderr after the last one; `--table-out FILE` writes it to
FILE instead. `--from-json` trains nothing: it summarises the runs of earlier `--json-out` files
again from their metrics.jsonl, with this invocation's `--target` and `--max-minutes`, so runs
made by separate commands make one table, and another target costs no GPU time.

Issue 17's table, a 5-minute training budget per preset, one command per preset, then the table.
The step counts are sized from the H100 wall times in docs/shapes.md (estimates, validations and
start-up included: ~2 s a step for the Flow-GRPO family, ~1 s for DPO, ~3.5 s for DanceGRPO,
DiffusionNFT and AWM), to fill the budget and keep each command near 10 minutes; a run whose
`stopped_by` is "steps" ended before its budget and wants more `--steps`:

    OUT=runs/bench_shapes
    for p in shapes_flow_grpo shapes_grpo_guard shapes_flow_dppo shapes_mixgrpo; do
      python benchmarks/shapes_algorithms.py $p --steps 200 --max-minutes 5 --out $OUT --json-out $OUT/runs.jsonl
    done
    python benchmarks/shapes_algorithms.py shapes_dpo --steps 300 --max-minutes 5 --out $OUT --json-out $OUT/runs.jsonl
    for p in shapes_dancegrpo shapes_nft shapes_awm; do
      python benchmarks/shapes_algorithms.py $p --steps 100 --max-minutes 5 --out $OUT --json-out $OUT/runs.jsonl
    done
    python benchmarks/shapes_algorithms.py --from-json $OUT/runs.jsonl --max-minutes 5 --table-out $OUT/table.md

A preset whose learning rate decays over `trainer.total_steps` (e.g. `actor.optim.scheduler=cosine`)
has not finished decaying where the budget cuts it.

The held-out runs in docs/shapes.md and docs/performance.md (before this script defaulted to the
train split and a validation every 5 steps) validated every `--steps // 3` steps: repeat them with
`--split heldout --val-every 20` at `--steps 60`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffrl.config import load_config
from diffrl.config.loader import preset_names
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

#: The algorithm each preset trains, as docs/algorithms.md names it (other presets: their loss).
ALGORITHMS = {
    "shapes_flow_grpo": "Flow-GRPO",
    "shapes_grpo_guard": "GRPO-Guard",
    "shapes_flow_dppo": "Flow-DPPO",
    "shapes_mixgrpo": "MixGRPO",
    "shapes_dancegrpo": "DanceGRPO",
    "shapes_nft": "DiffusionNFT",
    "shapes_nft_cfg_free": "DiffusionNFT (CFG-free)",
    "shapes_awm": "AWM",
    "shapes_dpo": "online Diffusion-DPO",
}
#: shapes_* presets that are not an RL algorithm of their own.
# shapes_base: the base of the others, Flow-GRPO again (shapes_flow_grpo is the algorithm's run)
NOT_ALGORITHMS = (
    "shapes_sft",
    "shapes_edit_sft",
    "shapes_async",
    "shapes_edit",
    "shapes_base",
    "shapes_dmd",
)  # shapes_dmd: distillation, another task

ACCURACY = "val/accuracy"
STEP_SECONDS = "timing_s/step"
THROUGHPUT = "throughput/images_per_s_per_gpu"


def default_presets() -> list[str]:
    return [n for n in preset_names() if n.startswith("shapes_") and n not in NOT_ALGORITHMS]


def curve_summary(
    steps: Mapping[int, Mapping[str, Any]], target: float, budget_s: float | None = None
) -> dict[str, Any]:
    """Time to `target` accuracy, throughput and the accuracy curve of one run's metrics.

    steps: {step: metrics} as `read_metrics` returns for a metrics.jsonl (step 0 = the validation
    before training, if any). Training seconds are cumulative: step s ends at
    train_s(s) = Σ_{1 <= i <= s} timing_s/step(i), validation and checkpoints excluded. With a
    budget, only steps with train_s(s) <= budget_s count (those a run stopped at the budget would
    have finished). Returns:

        steps_run, train_s              the last counted step and its train_s
        stopped_by                      "budget" when steps were cut, else "steps"
        images_per_s_per_gpu            mean throughput over counted steps after the first
                                        (None with fewer than two counted steps)
        steps_to_target, train_s_to_target
                                        the first counted validated step with accuracy >= target
                                        and its train_s (None when never reached)
        accuracy_before, accuracy_after the first and last validated accuracy
        best_accuracy, best_step        the highest validated accuracy, its first step
        curve                           [{"step", "train_s", "accuracy"}] of each validated step
    """
    if not 0 <= target <= 1:
        raise ValueError(f"target accuracy {target} must be within [0, 1], e.g. 0.9")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"budget {budget_s} s must be > 0 (or None for no budget)")
    train_s = 0.0
    steps_run = 0
    cut = False
    throughputs: list[float] = []
    curve: list[dict[str, float]] = []
    for step, metrics in sorted(steps.items()):
        if step > 0:
            if STEP_SECONDS not in metrics:
                raise ValueError(
                    f"step {step} has no {STEP_SECONDS!r}: not a training run's metrics.jsonl "
                    f"(keys: {sorted(metrics)[:8]}...)"
                )
            if budget_s is not None and train_s + metrics[STEP_SECONDS] > budget_s:
                cut = True
                break
            train_s += metrics[STEP_SECONDS]
            steps_run = step
            if THROUGHPUT in metrics:
                throughputs.append(metrics[THROUGHPUT])
        accuracy = validation_metrics(dict(metrics)).get(ACCURACY)
        if accuracy is not None and math.isfinite(accuracy):
            curve.append({"step": step, "train_s": train_s, "accuracy": accuracy})
    reached = next((p for p in curve if p["accuracy"] >= target), None)
    best = max(curve, key=lambda p: p["accuracy"], default=None)  # max keeps the first of ties
    after_first = throughputs[1:]
    return {
        "steps_run": steps_run,
        "train_s": train_s,
        "stopped_by": "budget" if cut else "steps",
        "images_per_s_per_gpu": sum(after_first) / len(after_first) if after_first else None,
        "steps_to_target": reached["step"] if reached else None,
        "train_s_to_target": reached["train_s"] if reached else None,
        "accuracy_before": curve[0]["accuracy"] if curve else None,
        "accuracy_after": curve[-1]["accuracy"] if curve else None,
        "best_accuracy": best["accuracy"] if best else None,
        "best_step": best["step"] if best else None,
        "curve": curve,
    }


#: `--split both`: rows per category of each split in the validation file.
BOTH_SPLITS_PER_CATEGORY = 64
SPLITS = ("train", "heldout")


def write_both_splits(path: Path, per_category: int = BOTH_SPLITS_PER_CATEGORY) -> Path:
    """The `--split both` validation file: `balanced_rows(split, per_category)` of each split, data
    source `<split>_<category>` (written atomically; the same rows every time)."""
    from diffrl.toy.grammar import balanced_rows

    rows = [
        {**row, "data_source": f"{split}_{row['data_source']}"}
        for split in SPLITS
        for row in balanced_rows(split, per_category)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # runs started side by side share `path`
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path


def split_accuracy(val: Mapping[str, float], split: str) -> float | None:
    """The mean over `split`'s categories of `val/<split>_<category>/accuracy` (None: none logged)."""
    prefix = f"val/{split}_"
    values = [
        v for k, v in val.items() if k.startswith(prefix) and k.endswith("/accuracy") and k.count("/") == 2
    ]
    return sum(values) / len(values) if values else None


def split_curves(steps: Mapping[int, Mapping[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """{split: [{"step", "accuracy"}]} of a `--split both` run's validated steps."""
    curves: dict[str, list[dict[str, float]]] = {split: [] for split in SPLITS}
    for step, metrics in sorted(steps.items()):
        for split in SPLITS:
            accuracy = split_accuracy(metrics, split)
            if accuracy is not None:
                curves[split].append({"step": step, "accuracy": round(accuracy, 4)})
    return curves


def validation_override(
    split: str, train_files: Sequence[str], out: str = ".", per_category: int = BOTH_SPLITS_PER_CATEGORY
) -> list[str]:
    """The override that makes validation use `split`'s prompts (none: the preset's held-out file)."""
    if split == "both":
        path = write_both_splits(Path(out) / f"both_splits_{per_category}.jsonl", per_category)
        return [f"data.val_files={json.dumps([str(path)])}"]
    if split == "train":
        # JSON quotes each path, so one with a comma or a space stays one list entry.
        return [f"data.val_files={json.dumps(list(train_files))}"]
    return []


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _cell(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per run: the preset's algorithm, loss, images/s/GPU, steps and training seconds to
    the target, best accuracy (step), steps run (training seconds)."""
    if not results:
        return ""
    target, split = results[0]["target"], results[0]["split"]
    budget = results[0]["budget_s"]
    splits = {r["split"] for r in results}
    if len(splits) > 1:
        raise ValueError(
            f"the runs validated on different splits {sorted(splits)}: one table compares one split; "
            "make a table per split (--from-json with the --json-out file of each)"
        )
    header = (
        f"| algorithm (preset) | loss | images/s/GPU | steps to {split} accuracy {target:g} "
        f"| training s to {target:g} | best {split} accuracy (step) | steps run (training s"
        f"{f', budget {budget:g} s' if budget is not None else ''}) |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in results:
        reached = r["steps_to_target"] is not None
        cells = [
            f"{r['algorithm']} (`{r['preset']}`)",
            r["loss"],
            _cell(r["images_per_s_per_gpu"], ".1f"),
            str(r["steps_to_target"]) if reached else "not reached",
            _cell(r["train_s_to_target"], ".0f"),
            f"{r['best_accuracy']:.3f} ({r['best_step']})" if r["best_accuracy"] is not None else "—",
            f"{r['steps_run']} ({r['train_s']:.0f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: What a result keeps of its run, whatever target or budget summarises it (`--from-json`).
RUN_KEYS = (
    "preset",
    "algorithm",
    "loss",
    "trainer_type",
    "split",
    "val_files",
    "steps",
    "val_every",
    "images_per_step",
    "wall_s",
    "run_dir",
)


def result_of(run: Mapping[str, Any], target: float, budget_s: float | None) -> dict[str, Any]:
    """One JSON line: the run's facts (`RUN_KEYS`) and its metrics.jsonl summarised for `target`
    within `budget_s` (`curve_summary`)."""
    metrics = Path(run["run_dir"]) / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: run {run['preset']!r} left no metrics there")
    steps = read_metrics(metrics)
    summary = curve_summary(steps, target, budget_s)
    extra = {"split_curves": split_curves(steps)} if run["split"] == "both" else {}
    return {
        **{k: run[k] for k in RUN_KEYS},
        "target": target,
        "budget_s": budget_s,
        **{k: summary[k] for k in ("steps_run", "stopped_by", "steps_to_target", "best_step")},
        "train_s": round(summary["train_s"], 2),
        "train_s_to_target": _rounded(summary["train_s_to_target"], 2),
        "images_per_s_per_gpu": _rounded(summary["images_per_s_per_gpu"], 2),
        "accuracy_before": _rounded(summary["accuracy_before"], 4),
        "accuracy_after": _rounded(summary["accuracy_after"], 4),
        "best_accuracy": _rounded(summary["best_accuracy"], 4),
        "accuracy_curve": [
            {"step": p["step"], "train_s": round(p["train_s"], 2), "accuracy": round(p["accuracy"], 4)}
            for p in summary["curve"]
        ],
        **extra,
    }


def run_preset(preset: str, args: argparse.Namespace, overrides: Sequence[str]) -> dict[str, Any]:
    """Train `preset` at GPU scale; returns the run's facts (`RUN_KEYS`)."""
    from diffrl.controller.run import train

    base = [
        *GPU_SCALE,
        f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.val_every}",
        f"trainer.save_freq={args.steps}",
        f"trainer.output_dir={args.out}",
        f"trainer.run_name={preset}",
        "trainer.resume=off",
        "trainer.val_before_train=true",
    ]
    # The train files as this run resolves them (an override after `--` may change them).
    train_files = load_config(preset, [*base, *overrides]).data.train_files
    run_overrides = [
        *base,
        *validation_override(args.split, train_files, args.out, args.val_per_category),
        *overrides,
    ]
    cfg = load_config(preset, run_overrides)
    start = time.perf_counter()
    run_dir = train(preset, run_overrides)
    wall = time.perf_counter() - start
    return {
        "preset": preset,
        "algorithm": ALGORITHMS.get(preset, cfg.actor.loss.mode),
        "loss": cfg.actor.loss.mode,
        "trainer_type": cfg.algorithm.trainer_type,
        "split": args.split,
        "val_files": list(cfg.data.val_files),
        "steps": cfg.trainer.total_steps,
        "val_every": cfg.trainer.test_freq,
        "images_per_step": cfg.images_per_step,
        "wall_s": round(wall, 1),  # the whole run: start-up and validations included
        "run_dir": str(run_dir),
    }


def earlier_runs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The runs named by JSON lines an earlier invocation wrote with `--json-out`."""
    runs = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--from-json {path}: no such file (write one with --json-out)")
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in RUN_KEYS if k not in row]
            if missing:
                raise ValueError(f"{path}:{n} lacks {missing}: not a line of this script's --json-out")
            runs.append({k: row[k] for k in RUN_KEYS})
    return runs


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's options, and the `key=value` overrides after `--`."""
    argv = list(argv)
    # Split at `--` here: argparse would read overrides as presets when no preset is named.
    cut = argv.index("--") if "--" in argv else len(argv)
    options, overrides = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("presets", nargs="*", help="presets to run (default: every shapes algorithm preset)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (trainer.total_steps)")
    parser.add_argument(
        "--split", choices=("train", "heldout", "both"), default="train", help="validation prompts"
    )
    parser.add_argument(
        "--val-per-category",
        type=int,
        default=BOTH_SPLITS_PER_CATEGORY,
        help="--split both: validation rows per category of each split",
    )
    parser.add_argument("--target", type=float, default=0.9, help="accuracy to time (val/accuracy)")
    parser.add_argument("--val-every", type=int, default=5, help="steps between validations")
    parser.add_argument("--max-minutes", type=float, default=None, help="training-time budget per run")
    parser.add_argument("--table", action="store_true", help="print a Markdown table to stderr at the end")
    parser.add_argument("--table-out", default=None, help="write the Markdown table to this file")
    parser.add_argument("--out", default="runs/bench_shapes", help="trainer.output_dir of the runs")
    parser.add_argument("--json-out", default=None, help="also append each run's JSON line to this file")
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="FILE",
        help="train nothing: summarise the runs of earlier --json-out files again (this --target, --max-minutes)",
    )
    args = parser.parse_args(options)
    if args.val_per_category < 1:
        parser.error(f"--val-per-category {args.val_per_category} must be >= 1")
    if args.steps < 1 or args.val_every < 1:
        parser.error(f"--steps ({args.steps}) and --val-every ({args.val_every}) must be >= 1")
    if not 0 <= args.target <= 1:
        parser.error(f"--target {args.target} must be an accuracy within [0, 1], e.g. 0.9")
    if args.max_minutes is not None and args.max_minutes <= 0:
        parser.error(f"--max-minutes {args.max_minutes} must be > 0 (leave it out for no budget)")
    if args.from_json and (args.presets or overrides):
        parser.error("--from-json trains nothing: name no preset and no override with it")
    unknown = [o for o in overrides if "=" not in o]
    if unknown:
        parser.error(f"after `--` come key=value overrides only, got {unknown}")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    budget_s = args.max_minutes * 60 if args.max_minutes is not None else None
    if args.from_json:
        runs = iter(earlier_runs(args.from_json))
    else:
        runs = (run_preset(preset, args, overrides) for preset in args.presets or default_presets())
    for out in (args.json_out, args.table_out):
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    results = []
    for run in runs:
        result = result_of(run, args.target, budget_s)
        line = json.dumps(result)
        print(line, flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(line + "\n")
        results.append(result)
    if args.table_out:
        Path(args.table_out).write_text(markdown_table(results))
    elif args.table:
        print(markdown_table(results), file=sys.stderr, end="")
    return results


if __name__ == "__main__":
    main()
