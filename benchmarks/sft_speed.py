"""`diffrl sft` update speed on this machine: the shapes edit model against the text-to-image toy.

One SFT step's update (ActorWorker.flow_matching_backward over the step's micro-batches, then the
optimizer step), full fine-tuning in float32, for each preset at the same batch: `shapes_sft` on
`tiny:toy` (the pixel-space SD3, 256 image tokens) and `shapes_edit_sft` on `tiny:toy_edit` (the
pixel-space FLUX.1 Kontext, 256 image + 256 condition tokens). Images are rendered once per
round (the time of rendering them is reported apart: `diffrl sft` renders on the fly). The two
models alternate, round after round, so a machine shared with other work slows both alike; the
best round is the machine's speed, the median what a run sees.

    OMP_NUM_THREADS=2 python benchmarks/sft_speed.py              # 2 CPU cores, ~2 minutes
    python benchmarks/sft_speed.py --images 64 --rounds 5

Prints one JSON line: images/s of each model's update (best and median over rounds), and the
rendering rate of the edit task's (target, source) pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from diffrl.config import load_config
from diffrl.data.images import load_image_rows
from diffrl.data.prompts import load_prompts
from diffrl.seeding import SFT_STREAM, derive_seed
from diffrl.toy import SHAPES, SHAPES_EDIT
from diffrl.workers.roles import ActorWorker, ImageShard

PRESETS = {"toy": ("shapes_sft", "tiny:toy"), "toy_edit": ("shapes_edit_sft", "tiny:toy_edit")}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=64, help="images per step (default 64)")
    parser.add_argument("--micro", type=int, default=32, help="actor.micro_batch_size (default 32)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    workers, batches, render_s = {}, {}, {}
    for name, (preset, model) in PRESETS.items():
        cfg = load_config(
            preset,
            [
                f"model.path={model}",
                "model.dtype=float32",
                "actor.strategy=none",
                f"data.prompts_per_step={args.images}",
                f"actor.mini_batch_size={args.images}",
                f"actor.micro_batch_size={args.micro}",
            ],
            job="sft",
        )
        from diffrl.controller.preflight import data_path

        records = load_prompts([data_path(f) for f in cfg.data.train_files], "prompt", None)
        records = (records * (args.images // len(records) + 1))[: args.images]
        source = cfg.sft.images
        rows = [r.metadata["scene" if source == SHAPES else "edit"] for r in records]
        seeds = [derive_seed(SFT_STREAM, 0, 0, i, 1) for i in range(len(rows))]
        start = time.perf_counter()
        arrays = load_image_rows(source, rows, 32, 32, seeds)
        render_s[name] = time.perf_counter() - start
        conditions = None
        if source == SHAPES_EDIT:
            from PIL import Image

            arrays, sources = arrays[:, 0], arrays[:, 1]
            conditions = [[Image.fromarray(s)] for s in sources]
        pixels = torch.from_numpy(arrays.copy()).permute(0, 3, 1, 2).contiguous()
        batches[name] = ImageShard([r.prompt for r in records], pixels, 0, conditions)
        workers[name] = ActorWorker(cfg)

    times: dict[str, list[float]] = {name: [] for name in PRESETS}
    for step in range(args.rounds + 1):
        for name, worker in workers.items():
            start = time.perf_counter()
            worker.flow_matching_backward(batches[name], seed=0, step=step)
            worker.optim_step()
            if step:  # the first round warms up
                times[name].append(time.perf_counter() - start)

    out = {
        "images_per_step": args.images,
        "micro_batch_size": args.micro,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
    }
    for name in PRESETS:
        out[f"{name}_images_per_s_best"] = round(args.images / min(times[name]), 2)
        out[f"{name}_images_per_s_median"] = round(args.images / statistics.median(times[name]), 2)
        out[f"{name}_render_images_per_s"] = round(args.images / render_s[name], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
