"""How much noise do SDE steps at the end of a trajectory leave in the shapes world's pixels?

    OMP_NUM_THREADS=1 python benchmarks/shapes_sde_noise.py [--n 4] [--seed 42] [--rows 96] [key=value ...]

The question: with the Flow-GRPO SDE on the last step the final sample keeps noise of std
η·sqrt(σ/(1−σ))·sqrt(σ) (diffrl/sde.py), and the toy model is pixel space, so the verifier would
read that noise. This samples the `shapes_flow_grpo` preset's held-out validation file (`data.val_files`)
with `toy:shapes`, `--n` samples per prompt, under five samplers that all start from the same
initial noise (sample i is keyed (seed, 0, i) in both `sample_validation` and `sample`):

- `ode`: the validation sampler (Euler, no noise);
- `window_0_2`: a training rollout with the preset's SDE window (steps 0–1 SDE, the rest ODE);
- `all_sde`: every step SDE (`rollout.sde.window_size=null rollout.sde.window_range=null`);
- `sde_0_9`: SDE on steps 0–8, the last step ODE (`window_range=[0,9]`, window_size null);
- `sde_0_8`: SDE on steps 0–7, the last two steps ODE (`window_range=[0,8]`).

SDE noise is drawn from each sample's own generator, one draw per SDE step in order, so all_sde,
sde_0_9 and sde_0_8 share x_k up to where their windows end (checked): the difference of their
final samples is exactly what the SDE did on the steps where they differ. Scores are the `shapes`
reward's binary accuracy (the verifier), per category and overall, with standard errors that
treat a prompt's samples as one cluster (the std of per-prompt means / sqrt(prompts)); the change
from `ode` is paired by prompt. The noise is reported in pixel levels (0–255; the toy model's
latents are pixels in [-1, 1], so one latent unit is 127.5 levels), before uint8 rounding.

Extra `key=value` overrides apply to the preset (e.g. `rollout.sde.noise_level=0.5`). Prints one
JSON line. The noise generators live on `--device`, so a CUDA run draws other noise than a CPU run
of the same seed. Time: ~100 s per sampler on two dedicated CPU cores (~9 min in all with the
defaults; `--n 2` halves it), ~10 s in all on an H100 (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from diffrl.config import load_config
from diffrl.controller.preflight import data_path
from diffrl.data import load_prompts
from diffrl.models import load_model
from diffrl.rewards.shapes import ShapesReward
from diffrl.rollout import TrajectorySampler

PIXEL_LEVELS_PER_UNIT = 127.5  # to_uint8: ((x / 2 + 0.5) * 255)

SAMPLERS = {
    "ode": None,  # the validation sampler
    "window_0_2": [],  # the preset's own window
    "all_sde": ["rollout.sde.window_size=null", "rollout.sde.window_range=null"],
    "sde_0_9": ["rollout.sde.window_size=null", "rollout.sde.window_range=[0,9]"],
    "sde_0_8": ["rollout.sde.window_size=null", "rollout.sde.window_range=[0,8]"],
}


def clustered(values_PN: np.ndarray) -> tuple[float, float]:
    """(mean, se) over prompts of a [prompts, samples] array: a prompt's samples are one cluster."""
    per_prompt = values_PN.mean(axis=1)
    se = per_prompt.std(ddof=1) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else float("nan")
    return float(per_prompt.mean()), float(se)


def pixel_std(diff: torch.Tensor) -> float:
    """RMS of a latent-space difference, in pixel levels."""
    return float(diff.float().pow(2).mean().sqrt() * PIXEL_LEVELS_PER_UNIT)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=42, help="noise seed (the preset's trainer.seed)")
    parser.add_argument("--rows", type=int, default=None, help="first ROWS prompts only (a quick check)")
    parser.add_argument("--device", default="cpu")
    args, overrides = parser.parse_known_args()
    if args.n < 2:
        raise ValueError(f"--n {args.n}: rollout.n must be >= 2 for training rollouts; pass --n 2 or more")

    base = load_config("shapes_flow_grpo", overrides)
    records = load_prompts([data_path(p) for p in base.data.val_files], base.data.prompt_key)
    if args.rows is not None:
        records = records[: args.rows]
    prompts = [r.prompt for r in records]
    metadata = [r.metadata for r in records]
    categories = [r.data_source or "default" for r in records]
    adapter = load_model(base.model.path, dtype="float32", device=args.device)
    images_per_step = base.data.prompts_per_step * args.n
    reward = ShapesReward(score="binary")

    started = time.perf_counter()
    rollouts, results = {}, {}
    for name, extra in SAMPLERS.items():
        cfg = load_config(
            "shapes_flow_grpo",
            [
                *overrides,
                *(extra or []),
                f"rollout.n={args.n}",
                f"rollout.val.n={args.n}",
                # nothing trains here, but the config must stay valid for any --n
                f"actor.mini_batch_size={images_per_step}",
                f"actor.micro_batch_size={images_per_step}",
                f"rollout.val.seed={args.seed}",
            ],
        )
        sampler = TrajectorySampler(adapter, cfg.rollout, progress=False)
        t0 = time.perf_counter()
        if extra is None:
            rollout = sampler.sample_validation(prompts, metadata=metadata)
        else:
            rollout = sampler.sample(prompts, seed=args.seed, step=0, metadata=metadata)
        samples = rollout.samples
        p_B = samples.prompt_index_B.tolist()
        out = reward.score_images(samples.pixels, [prompts[p] for p in p_B], [metadata[p] for p in p_B])
        # samples are prompt-major (prompt p's n samples are rows p·n .. p·n + n − 1)
        accuracy_PN = out.extras["accuracy"].numpy().reshape(len(prompts), args.n)
        partial_PN = out.extras["partial"].numpy().reshape(len(prompts), args.n)
        rollouts[name] = rollout
        results[name] = {
            "sde_steps": rollout.step_indices.tolist(),
            "seconds": round(time.perf_counter() - t0, 1),
            "accuracy_PN": accuracy_PN,
            "partial_PN": partial_PN,
        }
        print(f"{name}: accuracy {accuracy_PN.mean():.3f} ({results[name]['seconds']} s)", file=sys.stderr)

    report: dict = {
        "model": base.model.path,
        "val_files": base.data.val_files,
        "prompts": len(prompts),
        "samples_per_prompt": args.n,
        "seed": args.seed,
        "overrides": overrides,
        "steps": base.rollout.pipeline.num_inference_steps,
        "guidance_scale": base.rollout.pipeline.guidance_scale,
        "noise_level": base.rollout.sde.noise_level,
        "accuracy": {},
    }
    ode_PN = results["ode"]["accuracy_PN"]
    for name, res in results.items():
        acc_PN = res["accuracy_PN"]
        mean, se = clustered(acc_PN)
        diff, diff_se = clustered(acc_PN - ode_PN)
        entry = {
            "sde_steps": res["sde_steps"],
            "overall": [round(mean, 4), round(se, 4)],
            "minus_ode": [round(diff, 4), round(diff_se, 4)],
            "partial": round(float(res["partial_PN"].mean()), 4),
            "seconds": res["seconds"],
        }
        for cat in sorted(set(categories)):
            rows = [i for i, c in enumerate(categories) if c == cat]
            m, s = clustered(acc_PN[rows])
            entry[cat] = [round(m, 4), round(s, 4)]
        report["accuracy"][name] = entry

    # --- the noise the last SDE steps leave in the final sample ------------------------------
    schedule = adapter.schedule(base.rollout.pipeline.num_inference_steps, 32, 32)
    sigmas = [float(s) for s in schedule.sigmas]
    eta = base.rollout.sde.noise_level
    last = len(sigmas) - 2  # index of the last step: σ_last -> 0
    all_sde = rollouts["all_sde"].samples
    sde_0_9 = rollouts["sde_0_9"].samples
    sde_0_8 = rollouts["sde_0_8"].samples
    # The shared prefixes the comparison relies on (the same generator draws in the same order).
    x_last_shared = float((all_sde.window_latents[:, last] - sde_0_9.window_latents[:, last]).abs().max())
    x_prev_shared = float(
        (all_sde.window_latents[:, last - 1] - sde_0_8.window_latents[:, last - 1]).abs().max()
    )

    def closed_form(k: int) -> float:
        """The `sde` transition std of step k in pixel levels: η·sqrt(σ/(1−σ̃))·sqrt(σ−σ')."""
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        tilde = float(schedule.sigma_1) if sigma == 1 else sigma
        return eta * math.sqrt(sigma / (1 - tilde)) * math.sqrt(sigma - sigma_next) * PIXEL_LEVELS_PER_UNIT

    pixels_changed = (all_sde.pixels != sde_0_8.pixels).float().mean()
    report["noise"] = {
        "sigmas": [round(s, 4) for s in sigmas],
        "step_std_pixels": {
            "recorded": [round(float(s) * PIXEL_LEVELS_PER_UNIT, 3) for s in all_sde.stds_BW[0]],
            "closed_form": [round(closed_form(k), 3) for k in range(last + 1)],
        },
        "last_step": {
            "sigma": sigmas[last],
            # the issue's form η·sqrt(σ/(1−σ))·sqrt(σ) at the last step's σ (σ' = 0)
            "closed_form_pixels": round(
                eta
                * math.sqrt(sigmas[last] / (1 - sigmas[last]))
                * math.sqrt(sigmas[last])
                * PIXEL_LEVELS_PER_UNIT,
                4,
            ),
            "final_minus_sde_mean_pixels": round(
                pixel_std(all_sde.final_latents - all_sde.means[:, last]), 4
            ),
            "final_minus_ode_continuation_pixels": round(
                pixel_std(all_sde.final_latents - sde_0_9.final_latents), 4
            ),
            "shared_x_max_abs_diff": x_last_shared,
        },
        "second_to_last_step": {
            "sigma": sigmas[last - 1],
            "closed_form_pixels": round(closed_form(last - 1), 4),
            "its_noise_in_final_pixels": round(pixel_std(sde_0_9.final_latents - sde_0_8.final_latents), 4),
            "shared_x_max_abs_diff": x_prev_shared,
        },
        "last_two_steps_in_final_pixels": round(pixel_std(all_sde.final_latents - sde_0_8.final_latents), 4),
        "uint8_pixels_changed_all_sde_vs_sde_0_8": round(float(pixels_changed), 4),
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
