"""Does a step along the estimated policy gradient raise the reward? A finite-difference check.

    python benchmarks/gradient_direction.py "three squares" [--samples 4096] [--alphas 0,0.03,-0.03,0.1,-0.1] [key=value ...]

On one shapes prompt with the `shapes_flow_grpo` preset (plus overrides, e.g. `rollout.sde.window_range=[3,5]`
or `model.lora.rank=0`): sample `--samples` SDE-window trajectories, score them with the shapes
verifier, accumulate the Flow-GRPO gradient g of that batch (on-policy: ratio 1, so it is the
REINFORCE estimate), then for each α set the weights to θ − α·g/|g| (α > 0 is the estimated
ascent direction of the reward) and score 2×`--samples` fresh trajectories (other seeds, the same
window). Prints one JSON line per α: accuracy and partial score. If the estimate is the reward's
gradient, the scores rise for small α > 0 and fall for α < 0.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from diffrl.config import load_config
from diffrl.rollout.sampler import TrajectorySampler
from diffrl.toy.grammar import parse_prompt
from diffrl.toy.verify import verify_batch
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import TrainEngine
from diffrl.workers.roles import build_adapter


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--alphas", default="0,0.03,-0.03,0.1,-0.1")
    parser.add_argument("--micro", type=int, default=512)
    args, overrides = parser.parse_known_args()
    n = args.samples
    cfg = load_config(
        "shapes_flow_grpo",
        [
            f"rollout.n={n}",
            f"rollout.micro_batch_size={args.micro}",
            f"actor.micro_batch_size={args.micro}",
            f"actor.mini_batch_size={n}",
            *overrides,
        ],
    )
    adapter = build_adapter(cfg)
    sampler = TrajectorySampler(adapter, cfg.rollout, progress=False)
    engine = TrainEngine(adapter, cfg.model, cfg.actor, total_optim_steps=1)
    scene = parse_prompt(args.prompt)

    def score(pixels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        correct, partial = verify_batch(pixels.cpu(), [scene] * pixels.shape[0])
        return np.asarray(correct, dtype=float), np.asarray(partial, dtype=float)

    start = time.perf_counter()
    rollout = sampler.sample([args.prompt], seed=0, step=3)
    correct, partial = score(rollout.samples.pixels)
    rewards = torch.tensor(partial, dtype=torch.float32)  # partial credit, as the recorded results used
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    trained = PolicyGradientBatch(rollout, TrainingTargets(advantages_B=advantages, batch_size=[n]))
    engine.forward_backward([trained.select(slice(i, i + args.micro)) for i in range(0, n, args.micro)])
    grads = [p.grad.detach().clone() for p in engine.params]
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
    base = [p.detach().clone() for p in engine.params]
    common = {
        "prompt": args.prompt,
        "window": rollout.step_indices.tolist(),
        "samples": n,
        "overrides": overrides,
        "train_accuracy": float(correct.mean()),
        "grad_norm": float(norm),
        "gradient_s": round(time.perf_counter() - start, 1),
    }
    for alpha in (float(a) for a in args.alphas.split(",")):
        with torch.no_grad():
            for p, b, g in zip(engine.params, base, grads, strict=True):
                p.copy_(b - alpha * g / norm)
        correct, partial = score(sampler.sample([args.prompt] * 2, seed=123, step=3).samples.pixels)
        result = {"alpha": alpha, "accuracy": float(correct.mean()), "partial": float(partial.mean())}
        print(json.dumps({**common, **result}), flush=True)


if __name__ == "__main__":
    main()
