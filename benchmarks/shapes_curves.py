"""Curves of shapes runs validated on both splits: accuracy per step, the fall after the peak, the
training metrics at the peak and at the end, and what the run-health watchdog said.

    python benchmarks/shapes_curves.py RUN_DIR ... [--names NAME ...] [--window 5] [--out FILE.md]
        [--json-out FILE.json] [--plot-dir DIR]

Each RUN_DIR is a run of `benchmarks/shapes_algorithms.py --split both` (validation data sources
`<split>_<category>`). Per split it reads every validation's per-sample verdicts
(`validation/step_N.jsonl`) and reports:

- accuracy (the mean over the split's six categories) per validated step, with each validation's
  standard error (per category the binomial error of its mean verdict, combined over the six);
- per run: the peak (the best validated step, the first of ties), the end, the largest fall after
  the peak in paired standard errors, and whether the run **holds**: no validation after the peak
  more than 2 paired standard errors below it (`first_fall_step` is the first that is). Paired:
  every validation of a run scores the same prompts from the same noise, so the error of a change
  is that of the per-sample differences, smaller than two independent errors combined;
- per category of the held-out split: base, peak and end;
- the training metrics at the held-out peak and at the end, each the mean over the `--window`
  logged steps up to it: the training reward (the rollout sampler's), KL to the base
  (`actor/kl`, logged only by losses with a KL term), the distance to the old policy
  (`actor/old_deviate`, DiffusionNFT), the grad norm before clipping, the ratio-clip fraction
  (losses that clip), the reward spread within groups (`rewards/std_mean`,
  `rewards/zero_std_ratio`), the largest advantage; and the share of steps whose grad norm
  exceeded the run's `actor.optim.clip_grad`;
- the first step at which each `health/<signal>` of the watchdog (`trainer.health`) held;
- with `RUN_DIR/groups/groups.jsonl` (`benchmarks/shapes_groups.py`): per checkpoint, the rollout
  and validation samplers' accuracy, the group diversity and the drift from the base's images.

`--plot-dir DIR` draws `curves_train.png` and `curves_heldout.png` there: each run's accuracy per
validated step.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffrl.config import load_config
from diffrl.telemetry.plots import line_plot
from diffrl.telemetry.sinks import read_metrics

SPLITS = ("train", "heldout")
CATEGORIES = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
TRAINING_METRICS = {
    "reward": "rewards/mean",
    "kl": "actor/kl",
    "old_dev": "actor/old_deviate",
    "grad_norm": "actor/grad_norm",
    "clipfrac": "actor/clipfrac",
    "std_mean": "rewards/std_mean",
    "zero_std": "rewards/zero_std_ratio",
    "adv_max": "advantages/max",
}
#: A fall after the peak larger than this many paired standard errors means the run does not hold.
HOLD_Z = 2.0
#: Line colours of the plots, one per run in order (then again).
COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]
COLOURS += [(140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34)]


def verdicts(run: Path) -> dict[int, list[dict[str, Any]]]:
    """{step: per-sample rows (index, data_source, correct), in index order} of each validation."""
    out = {}
    for path in sorted((run / "validation").glob("step_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[int(path.stem.split("_")[1])] = sorted(rows, key=lambda row: row["index"])
    if not out:
        raise FileNotFoundError(f"{run}/validation has no step_*.jsonl: not a validated run")
    return out


def by_category(rows: Sequence[Mapping[str, Any]], split: str) -> dict[str, list[float]]:
    """{category: verdicts (0/1) in sample order} of `split`'s samples (`<split>_<category>`)."""
    cats: dict[str, list[float]] = {}
    for row in rows:
        source = row["data_source"]
        if source.startswith(split + "_") and row.get("correct") is not None:
            cats.setdefault(source[len(split) + 1 :], []).append(float(row["correct"]))
    return cats


def accuracy_and_se(rows: Sequence[Mapping[str, Any]], split: str) -> tuple[float, float]:
    """The mean over categories of their accuracy, and its standard error: per category the
    variance of a mean of Bernoulli verdicts, m(1 − m)/(n − 1), summed, square-rooted, over k."""
    cats = by_category(rows, split)
    if not cats:
        raise ValueError(f"no `{split}_<category>` samples: was the run validated with --split both?")
    k = len(cats)
    means = {c: sum(v) / len(v) for c, v in cats.items()}
    var = sum(m * (1 - m) / max(1, len(cats[c]) - 1) for c, m in means.items())
    return sum(means.values()) / k, math.sqrt(var) / k


def paired_difference(a: Sequence[Mapping], b: Sequence[Mapping], split: str) -> tuple[float, float]:
    """accuracy(b) − accuracy(a) and its paired standard error: per category the mean and the
    standard error of the per-sample differences (the same samples, in order), combined over k."""
    ca, cb = by_category(a, split), by_category(b, split)
    if ca.keys() != cb.keys() or any(len(ca[c]) != len(cb[c]) for c in ca):
        raise ValueError("the two validations hold different samples: they cannot be paired")
    k = len(ca)
    diff, var = 0.0, 0.0
    for c in ca:
        d = [y - x for x, y in zip(ca[c], cb[c], strict=True)]
        mean = sum(d) / len(d)
        diff += mean
        var += sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1) / len(d)
    return diff / k, math.sqrt(var) / k


def split_summary(vals: Mapping[int, Sequence[Mapping]], split: str) -> dict[str, Any]:
    """One split's curve, peak, end and falls after the peak (module docstring)."""
    curve = {step: accuracy_and_se(rows, split) for step, rows in sorted(vals.items())}
    peak = max(curve, key=lambda s: (curve[s][0], -s))
    end = max(curve)
    falls = [(s, *paired_difference(vals[peak], vals[s], split)) for s in curve if s > peak]
    # The worst fall in standard errors; an exact repeat (se 0) is no fall at all.
    z_of = {s: (d / se if se > 0 else (0.0 if d == 0 else -math.inf)) for s, d, se in falls}
    worst = min(falls, key=lambda f: z_of[f[0]], default=None)
    first_fall = next((s for s, _, _ in falls if z_of[s] < -HOLD_Z), None)
    end_fall = paired_difference(vals[peak], vals[end], split) if end != peak else (0.0, 0.0)
    cats = {step: by_category(rows, split) for step, rows in vals.items()}
    first = min(curve)
    return {
        "curve": {s: {"accuracy": round(a, 4), "se": round(e, 4)} for s, (a, e) in curve.items()},
        "base": round(curve[first][0], 4),
        "peak_step": peak,
        "peak": round(curve[peak][0], 4),
        "end_step": end,
        "end": round(curve[end][0], 4),
        "end_minus_peak": round(end_fall[0], 4),
        "end_minus_peak_se": round(end_fall[1], 4),
        "worst_after_peak": None
        if worst is None
        else {"step": worst[0], "change": round(worst[1], 4), "se": round(worst[2], 4)},
        "first_fall_step": first_fall,
        "holds": first_fall is None,
        "categories": {
            c: {
                at: round(sum(cats[s][c]) / len(cats[s][c]), 4)
                for at, s in (("base", first), ("peak", peak), ("end", end))
            }
            for c in cats[first]
        },
    }


def run_summary(run: Path, window: int) -> dict[str, Any]:
    vals = verdicts(run)
    metrics = read_metrics(run / "metrics.jsonl")
    out: dict[str, Any] = {"run": str(run), "splits": {split: split_summary(vals, split) for split in SPLITS}}
    out["training"] = {}
    for split in SPLITS:
        for label in ("peak", "end"):
            step = out["splits"][split][f"{label}_step"]
            out["training"][f"{split}_{label}"] = training_at(metrics, step, window)
    clip = load_config(str(run / "config.yaml")).actor.optim.clip_grad
    out["grad_clip"] = clip
    out["grad_clip_share"] = clip_share(metrics, clip)
    out["health_first"] = health_first(metrics)
    out["steps_run"] = max((s for s, m in metrics.items() if "rewards/mean" in m), default=0)
    groups = run / "groups" / "groups.jsonl"
    if groups.is_file():
        out["groups"] = [json.loads(line) for line in groups.read_text().splitlines() if line.strip()]
    return out


def training_at(metrics: Mapping[int, Mapping[str, Any]], step: int, window: int) -> dict[str, float | None]:
    """Each training metric's mean over the `window` logged steps ending at `step` (step 0, before
    training: the first logged step)."""
    steps = [s for s in sorted(metrics) if s >= 1 and "rewards/mean" in metrics[s]]
    chosen = [s for s in steps if max(1, step - window + 1) <= s <= max(step, 1)] or steps[:1]
    out: dict[str, float | None] = {}
    for label, key in TRAINING_METRICS.items():
        values = [metrics[s][key] for s in chosen if key in metrics[s]]
        out[label] = round(sum(values) / len(values), 5) if values else None
    return out


def clip_share(metrics: Mapping[int, Mapping[str, Any]], clip: float | None) -> float | None:
    """The share of optimizer steps whose grad norm (before clipping) exceeded `clip`; None when the
    run does not clip or logged no grad norm."""
    norms = [m["actor/grad_norm"] for m in metrics.values() if "actor/grad_norm" in m]
    if not norms or not clip:
        return None
    return round(sum(n > clip for n in norms) / len(norms), 3)


def health_first(metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, int]:
    """{signal: the first step at which `health/<signal>` held} for each signal that ever held."""
    first: dict[str, int] = {}
    for step, m in sorted(metrics.items()):
        for key, value in m.items():
            signal = key.removeprefix("health/")
            if key.startswith("health/") and signal != "val_drop_z" and value >= 1 and signal not in first:
                first[signal] = step
    return first


def markdown(summaries: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    lines = []
    for split in SPLITS:
        steps = sorted({s for r in summaries for s in r["splits"][split]["curve"]})
        lines.append(f"\n{split} split accuracy\n")
        lines.append(
            "| run | "
            + " | ".join(str(s) for s in steps)
            + " | peak (step) | end − peak (± paired se) | first fall > 2 se | holds |"
        )
        lines.append("|---|" + "---|" * (len(steps) + 4))
        for name, r in zip(names, summaries, strict=True):
            sp = r["splits"][split]
            cells = [f"{sp['curve'][s]['accuracy']:.3f}" if s in sp["curve"] else "" for s in steps]
            fall = "—" if sp["first_fall_step"] is None else str(sp["first_fall_step"])
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {sp['peak']:.3f} ({sp['peak_step']})"
                + f" | {sp['end_minus_peak']:+.3f} ± {sp['end_minus_peak_se']:.3f} | {fall}"
                + f" | {'yes' if sp['holds'] else 'no'} |"
            )
        se = [v["se"] for r in summaries for v in r["splits"][split]["curve"].values()]
        lines.append(f"\nstandard error of one validation: {min(se):.3f}–{max(se):.3f}")
    lines.append("\nheld-out accuracy per category: base → peak → end\n")
    lines.append("| run | " + " | ".join(CATEGORIES) + " |")
    lines.append("|---|" + "---|" * len(CATEGORIES))
    for name, r in zip(names, summaries, strict=True):
        cats = r["splits"]["heldout"]["categories"]
        cells = [
            f"{cats[c]['base']:.2f} → {cats[c]['peak']:.2f} → {cats[c]['end']:.2f}" if c in cats else "—"
            for c in CATEGORIES
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\ntraining metrics (mean of the steps up to it): at the held-out peak → at the end\n")
    lines.append(
        "| run | steps | " + " | ".join(TRAINING_METRICS) + " | grad-clipped steps | watchdog (first step) |"
    )
    lines.append("|---|---|" + "---|" * (len(TRAINING_METRICS) + 2))
    for name, r in zip(names, summaries, strict=True):
        peak, end = r["training"]["heldout_peak"], r["training"]["heldout_end"]
        cells = [f"{_fmt(peak[k])} → {_fmt(end[k])}" for k in TRAINING_METRICS]
        health = ", ".join(f"{s} {step}" for s, step in r["health_first"].items()) or "—"
        lines.append(
            f"| {name} | {r['steps_run']} | "
            + " | ".join(cells)
            + f" | {_fmt(r['grad_clip_share'])} | {health} |"
        )
    if any("groups" in r for r in summaries):
        lines.append(
            "\ncheckpoints: accuracy train / held-out, group diversity and drift from the base's images, "
            "rollout sampler | validation (ODE) sampler, held-out split\n"
        )
        lines.append(
            "| run | step | rollout acc train / heldout | rollout diversity | ODE acc train / heldout "
            "| ODE diversity | ODE drift |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for name, r in zip(names, summaries, strict=True):
            for g in r.get("groups", []):
                ro, va = g["rollout"], g["validation"]
                lines.append(
                    f"| {name} | {g['step']} | {ro['train']['accuracy']:.3f} / {ro['heldout']['accuracy']:.3f} "
                    f"| {ro['heldout']['diversity']:.3f} "
                    f"| {va['train']['accuracy']:.3f} / {va['heldout']['accuracy']:.3f} "
                    f"| {va['heldout']['diversity']:.3f} | {_fmt(va['heldout'].get('drift'))} |"
                )
    return "\n".join(lines) + "\n"


def plots(summaries: Sequence[Mapping[str, Any]], names: Sequence[str], out_dir: Path) -> list[Path]:
    """`curves_<split>.png` in `out_dir`: each run's accuracy per validated step."""
    paths = []
    for split in SPLITS:
        series = [
            (
                name,
                {s: v["accuracy"] for s, v in r["splits"][split]["curve"].items()},
                COLOURS[i % len(COLOURS)],
            )
            for i, (name, r) in enumerate(zip(names, summaries, strict=True))
        ]
        paths.append(
            line_plot(series, out_dir / f"curves_{split}.png", title=f"{split} split accuracy (val/accuracy)")
        )
    return paths


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--names", nargs="*", default=None, help="a short name per run (default: its folder)")
    parser.add_argument(
        "--window", type=int, default=5, help="logged steps averaged for the training metrics"
    )
    parser.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    parser.add_argument("--json-out", default=None, help="write the summaries as JSON here")
    parser.add_argument("--plot-dir", default=None, help="draw curves_train.png and curves_heldout.png here")
    args = parser.parse_args(argv)
    names = args.names or [Path(r).name for r in args.runs]
    if len(names) != len(args.runs):
        parser.error(f"{len(names)} --names for {len(args.runs)} runs: give one per run")
    if args.window < 1:
        parser.error(f"--window {args.window} must be >= 1")
    summaries = [run_summary(Path(r), args.window) for r in args.runs]
    text = markdown(summaries, names)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(dict(zip(names, summaries, strict=True)), indent=1))
    if args.plot_dir:
        plots(summaries, names, Path(args.plot_dir))
    return summaries


if __name__ == "__main__":
    main()
