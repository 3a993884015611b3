"""Would an evaluation-time EMA of the trained LoRA beat the final weights? One run, every decay.

    python benchmarks/shapes_ema.py [--decays 0.5,0.7,0.8,0.9] [--warmup-decays 0.9,0.95] [-- PRESET key=value ...]

Runs `diffrl train PRESET ...` (default: `default`, a direct-preference preset with LoRA) and keeps,
beside the run, one EMA of the trained adapter's tensors per decay d, updated after every optimizer
step: ema <- d·ema + (1 − d)·θ, starting from the adapter's initial weights (the base policy: LoRA's
B starts at zero). A `--warmup-decays` entry uses min(d, (1 + t) / (10 + t)) at optimizer step t,
the warm-up of flow_grpo's and DiffusionNFT's training scripts, so that the early weights fade.
After the last step the run validates, as it always does, then validates each EMA the same way
(its validation files, samples and seed; images to RUN/ema/<name>/validation/), and puts the
final weights back.

Prints one JSON line: the run directory, `val/accuracy` before training (when the run validates at
step 0), after it, and for each EMA, plus every `val/<category>/accuracy`; the same object is in
RUN/ema_validation.json. Nothing in the run changes: the checkpoint, the exported LoRA and the
report are those of the final weights.

docs/shapes-experiments.md ("Does an evaluation-time EMA of the adapter help the default job?") has
the 24-seed result for the default job, e.g.

    python benchmarks/shapes_ema.py -- default trainer.seed=S
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from diffrl.algos import DIRECT_PREFERENCE
from diffrl.config import load_config
from diffrl.controller import direct_preference
from diffrl.controller.run import train
from diffrl.controller.validation import run_validation
from diffrl.train.engine import POLICY


def parse_decays(text: str, flag: str) -> list[float]:
    if not text:
        return []
    try:
        decays = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give decays as comma-separated numbers, e.g. 0.5,0.9") from None
    bad = [d for d in decays if not 0.0 <= d <= 1.0]
    if bad:
        raise SystemExit(f"{flag}: decays {bad} are outside [0, 1]")
    return decays


def accuracies(metrics: dict[str, float]) -> dict[str, float]:
    """`val/accuracy` and each `val/<category>/accuracy` of a validation's metrics."""
    return {
        k: v
        for k, v in metrics.items()
        if k.startswith("val/") and k.endswith("/accuracy") and "rewards" not in k
    }


class AdapterEMAs:
    """EMAs of the trained adapter of the trainer's one in-process worker."""

    def __init__(self, constant: Sequence[float], warmup: Sequence[float]):
        self.variants = {f"ema_{d:g}": (d, False) for d in constant}
        self.variants.update({f"ema_{d:g}_warmup": (d, True) for d in warmup})
        self.averages: dict[str, dict[str, torch.Tensor]] = {}
        self.updates = 0
        self.results: dict[str, dict[str, float]] = {}

    @staticmethod
    def trained(trainer: Any) -> dict[str, torch.Tensor]:
        workers = getattr(trainer.workers, "workers", None)
        if not workers or len(workers) != 1:
            raise SystemExit(
                "shapes_ema.py needs one in-process trainer worker (the shapes presets' placement)"
            )
        engine = workers[0].engine
        params = {n: p for n, p in engine.transformer.named_parameters() if f".{POLICY}." in n}
        if not params:
            raise SystemExit("shapes_ema.py needs a LoRA run (model.lora.rank > 0)")
        return params

    def start(self, trainer: Any) -> None:
        initial = {n: p.detach().clone() for n, p in self.trained(trainer).items()}
        self.averages = {name: {n: t.clone() for n, t in initial.items()} for name in self.variants}

    @torch.no_grad()
    def update(self, trainer: Any) -> None:
        self.updates += 1
        t = self.updates
        params = self.trained(trainer)
        for name, (decay, warmup) in self.variants.items():
            d = min(decay, (1 + t) / (10 + t)) if warmup else decay
            for n, p in params.items():
                self.averages[name][n].mul_(d).add_(p, alpha=1.0 - d)

    @torch.no_grad()
    def validate_each(self, trainer: Any) -> None:
        """The run's validation of each EMA, written to RUN/ema/<name>/validation/: the run's own
        validation files (what the report's before/after grid shows) stay those of its weights."""
        params = self.trained(trainer)
        final = {n: p.detach().clone() for n, p in params.items()}
        try:
            for name, average in self.averages.items():
                for n, p in params.items():
                    p.copy_(average[n])
                metrics = run_validation(
                    trainer.cfg,
                    trainer.placement.samplers,
                    trainer.rewards,
                    trainer.val_records,
                    trainer.run_dir / "ema" / name,
                    trainer.step,
                )
                self.results[name] = accuracies(metrics)
        finally:
            for n, p in params.items():
                p.copy_(final[n])


@contextmanager
def tracked(emas: AdapterEMAs) -> Iterator[None]:
    """Hook the EMAs into the direct-preference trainer: after each optimizer step's old-policy
    update, and after fit() (whose last step validated the final weights)."""
    cls = direct_preference.DirectPreferenceTrainer
    original_update, original_fit = cls._update_old_policy, cls.fit
    last_steps = -1

    def update(self: Any) -> None:
        nonlocal last_steps
        original_update(self)
        steps = self.workers.call("report.optimizer_steps")[0]
        if steps != last_steps:  # a skipped (non-finite) step leaves the weights as they were
            last_steps = steps
            emas.update(self)

    def fit(self: Any) -> dict[str, float]:
        emas.start(self)
        last = original_fit(self)
        emas.results["final"] = accuracies(last)
        emas.validate_each(self)
        return last

    cls._update_old_policy, cls.fit = update, fit
    try:
        yield
    finally:
        cls._update_old_policy, cls.fit = original_update, original_fit


def main(argv: Sequence[str]) -> dict[str, Any]:
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decays", default="0.5,0.7,0.8,0.9", help="constant EMA decays (comma-separated)")
    parser.add_argument("--warmup-decays", default="0.9,0.95", help="decays with the (1+t)/(10+t) warm-up")
    args = parser.parse_args(argv[:cut])
    items = argv[cut + 1 :]
    source, overrides = (items[0], items[1:]) if items and "=" not in items[0] else ("default", items)
    emas = AdapterEMAs(
        parse_decays(args.decays, "--decays"), parse_decays(args.warmup_decays, "--warmup-decays")
    )
    if not emas.variants:
        raise SystemExit("name at least one decay (--decays or --warmup-decays)")
    if any(o.split("=", 1)[0] == "trainer.test_freq" and o.endswith("=0") for o in overrides):
        raise SystemExit(
            "trainer.test_freq=0 turns validation off: the EMAs are judged by the run's validation"
        )
    cfg = load_config(source, overrides)
    if cfg.algorithm.trainer_type != DIRECT_PREFERENCE or cfg.model.lora.rank <= 0:
        raise SystemExit(
            f"{source}: algorithm.trainer_type={cfg.algorithm.trainer_type}, model.lora.rank={cfg.model.lora.rank}; "
            "shapes_ema.py follows the direct-preference trainer's LoRA adapter: pick a preset such as "
            "default, shapes_nft or shapes_awm"
        )
    with tracked(emas):
        run_dir = train(source, overrides)
    if "final" not in emas.results:
        raise SystemExit(
            f"{run_dir} had finished before: nothing trained, so there are no EMAs (use a new run name)"
        )
    logged = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    before = next((m for m in logged if m.get("step") == 0 and "val/accuracy" in m), {})
    result = {
        "run_dir": str(run_dir),
        "optimizer_steps": emas.updates,
        "before": accuracies(before),
        **emas.results,
    }
    (run_dir / "ema_validation.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
