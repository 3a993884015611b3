"""What a shapes model draws for the held-out position prompts: the asked layout, or the trained one?

    python benchmarks/shapes_layouts.py [--model toy:shapes] [--lora DIR] [--n 64] [--steps 10]
        [--guidance-scale 1.0] [--seed 0] [--device cpu|cuda] [--out DIR]

The position split holds out one arrangement of three shape pairs ("a circle left of a square" and
its mirror phrasing "a square right of a circle", ...; docs/shapes.md, "Train and held-out
splits"). For each of those pairs and axes, training shows only the other arrangement: every
horizontal training prompt with a square has the square on the left, and every vertical one with
a circle and a triangle has the triangle on top. So two rules fit every training prompt: the
grammar's (the first-named object is left of / above the second) and a lookup by shape pair ("a
square goes left"). The reward on training prompts cannot tell them apart; the held-out prompts
can, since there the lookup draws exactly the wrong layout.

For each held-out position prompt, and for the training prompts of the same pairs and axes
(which show the trained arrangement), the script samples `--n` images with diffrl's sampler
(`diffrl sample`: same noise keying, ODE, `--steps` steps, `--guidance-scale`), reads every image
with the shapes verifier and sorts the images whose objects are exactly the prompt's two shapes:

- `asked`: the prompt's relation holds (the verifier's `relation` check);
- `swapped`: the opposite relation holds (the two objects the other way round: the arrangement
  the lookup draws);
- `neither`: e.g. side by side when the prompt asks for above.

Prints one JSON line: the settings, and per prompt group (`heldout`, `trained`) and per prompt the
number of images, how many hold exactly the two shapes, and the three counts.
docs/shapes-experiments.md ("Why does held-out position not move?") has the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from diffrl.rollout.generate import generate
from diffrl.toy.grammar import Scene, all_scenes, relation_holds, split_of
from diffrl.toy.model import RESOLUTION, T5_TOKENS
from diffrl.toy.verify import verify

AXIS = {"left of": "H", "right of": "H", "above": "V", "below": "V"}
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def layout(scene: Scene) -> tuple[str, str, str]:
    """(axis, the shape on the left or on top, the other one) of a position scene."""
    a, b = scene.objects[0].shape, scene.objects[1].shape
    first = scene.relation in ("left of", "above")
    return (AXIS[scene.relation], a, b) if first else (AXIS[scene.relation], b, a)


def prompt_groups() -> dict[str, list[Scene]]:
    """The held-out position scenes, and the training scenes of the same pairs on the same axes."""
    position = [s for s in all_scenes() if s.category == "position"]
    heldout = [s for s in position if split_of(s) == "heldout"]
    pairs = {(layout(s)[0], frozenset(layout(s)[1:])) for s in heldout}
    trained = [
        s for s in position if split_of(s) == "train" and (layout(s)[0], frozenset(layout(s)[1:])) in pairs
    ]
    return {"heldout": heldout, "trained": trained}


def classify(image: np.ndarray, scene: Scene) -> str:
    """ "asked", "swapped", "neither", or "other" (not exactly the prompt's two shapes) for one image."""
    verdict = verify(image, scene)
    checks = verdict.detail["checks"]
    shapes = [spec.shape for spec in scene.objects]
    if not (checks["no_extra"] and all(checks[f"count:{s}"] for s in shapes)):
        return "other"
    if checks["relation"]:
        return "asked"
    objects = verdict.detail["objects"]
    a = next(o for o in objects if o.shape == shapes[0])
    b = next(o for o in objects if o.shape == shapes[1])
    return "swapped" if relation_holds(OPPOSITE[scene.relation], a.box, b.box) else "neither"


def measure(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    groups = prompt_groups()
    scenes = [s for group in groups.values() for s in group]
    prompts = [s.to_prompt() for s in scenes]
    generate(
        args.model,
        prompts,
        out_dir,
        n=args.n,
        seed=args.seed,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        height=RESOLUTION,
        width=RESOLUTION,
        max_sequence_length=T5_TOKENS,
        device=args.device,
        dtype="float32",
        micro_batch_size=args.micro_batch_size,
        lora=args.lora,
    )
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    by_prompt: dict[str, dict[str, int]] = {
        p: {"images": 0, "asked": 0, "swapped": 0, "neither": 0, "other": 0} for p in prompts
    }
    scene_of = dict(zip(prompts, scenes, strict=True))
    for row in rows:
        image = np.asarray(Image.open(out_dir / row["file"]).convert("RGB"))
        counts = by_prompt[row["prompt"]]
        counts["images"] += 1
        counts[classify(image, scene_of[row["prompt"]])] += 1
    result: dict[str, Any] = {
        "model": args.model,
        "lora": args.lora,
        "n": args.n,
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
    }
    for name, group in groups.items():
        total = {
            k: sum(by_prompt[s.to_prompt()][k] for s in group)
            for k in ("images", "asked", "swapped", "neither", "other")
        }
        total["two_shapes"] = total["images"] - total["other"]
        result[name] = {"total": total, "prompts": {s.to_prompt(): by_prompt[s.to_prompt()] for s in group}}
    return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="toy:shapes", help="a shapes model (toy:shapes or a diffusers directory)"
    )
    parser.add_argument(
        "--lora", default=None, help="a LoRA directory on top of it (`diffrl export RUN --out DIR`)"
    )
    parser.add_argument("--n", type=int, default=64, help="images per prompt")
    parser.add_argument(
        "--steps", type=int, default=10, help="ODE sampling steps (the toy model's validation: 10)"
    )
    parser.add_argument(
        "--guidance-scale", type=float, default=1.0, help="CFG scale (1.0: none, the default job's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one)")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--out", default=None, help="keep the images here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.n < 1 or args.steps < 1:
        parser.error(f"--n ({args.n}) and --steps ({args.steps}) must be >= 1")
    return args


def main(argv: Sequence[str]) -> dict[str, Any]:
    args = parse_args(argv)
    if args.out is not None:
        result = measure(args, Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(args, Path(tmp))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
