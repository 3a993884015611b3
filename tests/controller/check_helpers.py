"""Rewards for tests/controller/test_check.py's broken setups (imported by path: `check_helpers:...`)."""

import torch


def one_short(pixels, prompts, metadata):
    """A reward that drops the last sample's score: one score fewer than samples."""
    return torch.zeros(len(prompts) - 1)


def not_finite(pixels, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))


def write_pairs(root, rows=2):
    """A preference dataset (`offline_dpo` needs one): rows of a prompt and two 32x32 images."""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    lines = []
    for i in range(rows):
        for side in ("a", "b"):
            image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(image).save(root / "images" / f"{i}{side}.png")
        lines.append(
            json.dumps(
                {"prompt": f"prompt {i}", "chosen": f"images/{i}a.png", "rejected": f"images/{i}b.png"}
            )
        )
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "pairs.jsonl"


def slow(pixels, prompts, metadata, seconds: float = 1.0):
    """A scorer that answers after `seconds`."""
    import time

    time.sleep(seconds)
    return torch.zeros(len(prompts))
