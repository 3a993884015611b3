"""What a shapes run's checkpoints sample: accuracy, group diversity, drift from the base, grids.

    python benchmarks/shapes_groups.py RUN_DIR [--steps 0 peak last 40 ...] [--per-category 4] [--n 16]
        [--out RUN_DIR/groups] [-- key=value ...]

For the base model (step 0) and each checkpoint `RUN_DIR/checkpoints/step_N` (every complete one
unless `--steps` names some; `peak` names the checkpoints at the held-out and the train split's
validation peaks, `last` the last checkpoint, each the latest complete one at or before that
step), samples `--n` images for each of `--per-category` prompts of every category of both splits
(`balanced_rows(split, per_category)`: the same prompts at every step), twice: with the run's
rollout sampler (its SDE window, `rollout.pipeline.num_inference_steps`, the trained adapter, the
seeds of a training step) and with its validation sampler (ODE, `rollout.val`). For each sampler
and split it reports:

- the verifier's accuracy (the mean over categories, as `val/accuracy`) and per category;
- the diversity of a prompt's group: the mean over groups of the mean pairwise RMS pixel distance
  between the group's images (pixels in [0, 1]; 0 when every image of a group is the same);
- the drift: the mean over samples of the RMS pixel distance between a sample and the base
  model's sample from the same noise (0 at step 0; only when step 0 is among the steps).

It writes `groups.jsonl` (one line per step) and, per step, `groups_step_N.png`: one row per
prompt of the held-out split's first prompts, 8 of its ODE samples, each captioned pass/fail.

The validation sampler draws the noise of the run's own validation (sample i of the file's row
r has the same noise in both), so with `--per-category` and `--n` equal to the run's
`--val-per-category` and `rollout.val.n` it reproduces the run's validation at that checkpoint.

The rollout sampler is what the reward sees during training and the validation sampler what the
curves report; a run whose rollout accuracy rises while its validation accuracy falls learns
something the ODE sampler does not reproduce, a group whose images grow alike has lost the spread
its advantages need, and a drift that keeps growing after the peak is a policy walking away from
the base model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from shapes_curves import split_summary as curve_split
from shapes_curves import verdicts

from diffrl.config import load_config
from diffrl.controller.run import worker_session
from diffrl.controller.sharding import prompt_shard
from diffrl.data.prompts import PromptRecord
from diffrl.telemetry import save_png
from diffrl.telemetry.images import image_grid
from diffrl.toy.grammar import balanced_rows
from diffrl.train.checkpoint import verify_checkpoint
from diffrl.workers.reward_workers import gather as gather_rewards

#: The seed stream of the rollout sampler's draws here: apart from any training step's.
DIAGNOSTIC_STEP = 10**6
SPLITS = ("train", "heldout")
GRID_PROMPTS = 12
GRID_SAMPLES = 8


def group_records(per_category: int) -> list[PromptRecord]:
    """`per_category` rows of every category of both splits, data source `<split>_<category>`."""
    records = []
    for split in SPLITS:
        for row in balanced_rows(split, per_category):
            meta = {**row, "data_source": f"{split}_{row['data_source']}"}
            meta.pop("prompt")
            records.append(
                PromptRecord(prompt=row["prompt"], metadata=meta, source=f"{split}:{len(records)}")
            )
    return records


def pairwise_diversity(pixels_GNCHW: torch.Tensor) -> torch.Tensor:
    """(G,) mean over pairs i < j of a group's RMS pixel distance, pixels uint8 → [0, 1]."""
    x = pixels_GNCHW.float().div(255.0).flatten(2)  # G, N, D
    n = x.shape[1]
    if n < 2:
        raise ValueError(f"diversity needs at least 2 samples per group, got {n}")
    dist = torch.cdist(x, x) / x.shape[2] ** 0.5  # G, N, N: RMS distance
    return dist.sum(dim=(1, 2)) / (n * (n - 1))


def drift_from(pixels_BCHW: torch.Tensor, base_BCHW: torch.Tensor) -> torch.Tensor:
    """(B,) RMS pixel distance of each sample to the base's sample of the same noise, in [0, 1]."""
    if pixels_BCHW.shape != base_BCHW.shape:
        raise ValueError(
            f"drift needs the base's samples in the same shape: {pixels_BCHW.shape} != {base_BCHW.shape}"
        )
    diff = pixels_BCHW.float().div(255.0) - base_BCHW.float().div(255.0)
    return diff.flatten(1).pow(2).mean(dim=1).sqrt()


def split_summary(
    sources: Sequence[str],
    correct: torch.Tensor,
    diversity_G: torch.Tensor,
    n: int,
    drift_B: torch.Tensor | None = None,
) -> dict:
    """Per split: accuracy as the mean over its categories (and per category), the mean group
    diversity and, given each sample's drift, its mean."""
    out: dict[str, Any] = {}
    group_sources = list(sources[::n])
    for split in SPLITS:
        cats = sorted({s for s in sources if s.startswith(split + "_")})
        per_cat = {c: float(correct[[s == c for s in sources]].float().mean()) for c in cats}
        mask = torch.tensor([s.startswith(split + "_") for s in group_sources])
        out[split] = {
            "accuracy": sum(per_cat.values()) / len(per_cat),
            "diversity": float(diversity_G[mask].mean()),
            "per_category": {c.split("_", 1)[1]: round(v, 4) for c, v in per_cat.items()},
        }
        if drift_B is not None:
            in_split = torch.tensor([s.startswith(split + "_") for s in sources])
            out[split]["drift"] = float(drift_B[in_split].mean())
    return out


def sample_both(cfg, workers, rewards, records, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, list]]:
    """{sampler: (pixels [B, 3, H, W], correct [B], sources [B])}: n samples per record, in order."""
    negative = cfg.rollout.pipeline.negative_prompt
    uids = [f"group:{i}" for i in range(len(records))]
    out = {}
    shard = prompt_shard(records, uids, 0, negative)
    summary, rollout = workers.call(
        "sample_and_score", shard, seed=cfg.rollout_seed, step=DIAGNOSTIC_STEP, rewards=rewards
    )[0]
    scores = gather_rewards(summary.extras["reward_handles"], cfg.trainer.worker_timeout_s)
    out["rollout"] = (rollout.samples.pixels, _correct(scores), _sources(rollout))
    val = workers.scatter("validate_and_score", [shard], rewards=rewards)[0]
    scores = gather_rewards(val.extras.pop("reward_handles"), cfg.trainer.worker_timeout_s)
    out["validation"] = (val.samples.pixels, _correct(scores), _sources(val))
    return out


def _correct(scores) -> torch.Tensor:
    key = next(k for k, v in scores.extras.items() if k.endswith("/accuracy") and v.ndim == 1)
    return scores.extras[key].float() >= 0.5


def _sources(rollout) -> list[str]:
    return [m["data_source"] for m in rollout.sample_metadata()]


def group_grid(pixels: torch.Tensor, correct: torch.Tensor, records: Sequence[PromptRecord], n: int):
    """Rows: the held-out split's first GRID_PROMPTS prompts; GRID_SAMPLES samples each."""
    held = [i for i, r in enumerate(records) if r.metadata["data_source"].startswith("heldout_")]
    # one prompt per category first, then the next of each
    by_cat: dict[str, list[int]] = {}
    for i in held:
        by_cat.setdefault(records[i].metadata["data_source"], []).append(i)
    order = [
        i
        for rank in range(max(map(len, by_cat.values())))
        for ids in by_cat.values()
        if rank < len(ids)
        for i in [ids[rank]]
    ]
    tiles, captions = [], []
    for i in order[:GRID_PROMPTS]:
        for j in range(min(n, GRID_SAMPLES)):
            k = i * n + j
            tiles.append(pixels[k])
            captions.append(f"{records[i].prompt}\n{'pass' if correct[k] else 'fail'}")
    return image_grid(
        torch.stack(tiles),
        nrow=GRID_SAMPLES,
        captions=captions,
        scale=3,
        caption_lines=4,
        font_size=11,
        pad_value=160,
    )


def checkpoint_steps(run: Path) -> dict[int, Path]:
    found = {}
    for path in sorted((run / "checkpoints").glob("step_*")):
        if (path / "complete").is_file():
            found[int(path.name.split("_")[1])] = path
    return found


def resolve_steps(run: Path, names: Sequence[str] | None, ckpts: Mapping[int, Path]) -> list[int]:
    """The steps `--steps` names: integers as they are (0 = the base), `peak` the latest checkpoint
    at or before each split's validation peak, `last` the last checkpoint; None: 0 and every one."""
    if names is None:
        return sorted({0, *ckpts})

    def at_or_before(step: int) -> int:
        return max((s for s in ckpts if s <= step), default=0)

    steps: set[int] = set()
    for name in names:
        if name == "last":
            steps.add(max(ckpts, default=0))
        elif name == "peak":
            vals = verdicts(run)
            steps.update(at_or_before(curve_split(vals, split)["peak_step"]) for split in SPLITS)
        elif name.isdigit():
            steps.add(int(name))
        else:
            raise ValueError(f"--steps {name!r}: give step numbers (0 = the base), `peak` or `last`")
    return sorted(steps)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a run directory (config.yaml, checkpoints/)")
    parser.add_argument(
        "--steps", nargs="*", default=None, help="steps (0 = the base model), `peak`, `last` (default: all)"
    )
    parser.add_argument("--per-category", type=int, default=4, help="prompts per category and split")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (a group)")
    parser.add_argument("--out", default=None, help="output folder (default RUN/groups)")
    args = parser.parse_args(argv[:cut])
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} has no config.yaml: not a run directory")
    ckpts = checkpoint_steps(run)
    steps = resolve_steps(run, args.steps, ckpts)
    missing = [s for s in steps if s != 0 and s not in ckpts]
    if missing:
        raise FileNotFoundError(f"{run} has no complete checkpoint for steps {missing} (has {sorted(ckpts)})")
    if args.n < 2 or args.per_category < 1:
        raise ValueError(f"--n {args.n} must be >= 2 and --per-category {args.per_category} >= 1")
    out = Path(args.out) if args.out else run / "groups"
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"rollout.n={args.n}",
        f"rollout.val.n={args.n}",
        "trainer.loggers=[jsonl]",
        *argv[cut + 1 :],
    ]
    cfg = load_config(str(run / "config.yaml"), overrides, job="eval")
    records = group_records(args.per_category)
    results = []
    base: dict[str, torch.Tensor] = {}  # each sampler's step-0 pixels, for the drift
    with worker_session(cfg) as (workers, rewards):
        for step in steps:  # ascending: step 0 runs before any checkpoint is loaded
            if step:
                verify_checkpoint(ckpts[step])
                workers.call("checkpoint.load", str(ckpts[step]))
            line: dict[str, Any] = {"run": str(run), "step": step, "n": args.n}
            for sampler, (pixels, correct, sources) in sample_both(
                cfg, workers, rewards, records, args.n
            ).items():
                if step == 0:
                    base[sampler] = pixels
                groups = pixels.view(len(records), args.n, *pixels.shape[1:])
                drift = drift_from(pixels, base[sampler]) if sampler in base else None
                line[sampler] = split_summary(sources, correct, pairwise_diversity(groups), args.n, drift)
                if sampler == "validation":
                    save_png(
                        out / f"groups_step_{step:06d}.png", group_grid(pixels, correct, records, args.n)
                    )
            print(json.dumps(line), flush=True)
            with open(out / "groups.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            results.append(line)
    return results


if __name__ == "__main__":
    main()
