"""User reward functions imported by path (`reward_test_helpers:NAME`) in the reward tests.

pytest puts this directory on sys.path (rootdir-relative "prepend" import mode), so the module is
importable by its bare name, as a user's own module on PYTHONPATH would be.
"""

import asyncio

import torch

from diffrl.rewards import RewardOutput

CALLS: list[int] = []


def mean_brightness(pixels, prompts, metadata, *, scale=1.0):
    """Mean pixel value in [0, 1], times `scale`; returns a plain list (sloppy output is accepted)."""
    return (pixels.float().mean(dim=tuple(range(1, pixels.ndim))) / 255.0 * scale).tolist()


async def async_prompt_length(pixels, prompts, metadata):
    await asyncio.sleep(0)
    return RewardOutput(
        torch.tensor([float(len(p)) for p in prompts]),
        {"words": torch.tensor([len(p.split()) for p in prompts])},
    )


class Constant:
    """A class reward: constructed once with its args, then called per batch."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, pixels, prompts, metadata):
        return torch.full((pixels.shape[0],), self.value)


def always_fails(pixels, prompts, metadata):
    raise RuntimeError("scorer exploded")


def wrong_shape(pixels, prompts, metadata):
    return torch.zeros(pixels.shape[0] + 1)


def returns_nan(pixels, prompts, metadata):
    return torch.full((pixels.shape[0],), float("nan"))


def count_calls(pixels, prompts, metadata):
    CALLS.append(pixels.shape[0])
    return torch.zeros(pixels.shape[0])


NOT_CALLABLE = 3


def slow(pixels, prompts, metadata, *, seconds=1.0):
    import time

    time.sleep(seconds)
    return torch.zeros(pixels.shape[0])


def rejects(pixels, prompts, metadata):
    raise ValueError("metadata lacks 'target'")


def fails_when_asked(pixels, prompts, metadata):
    """Fails on a batch whose first sample's metadata has fail=True; otherwise scores 1 with an extra."""
    if metadata[0].get("fail"):
        raise ConnectionError("remote scorer hiccup")
    return RewardOutput(torch.ones(pixels.shape[0]), {"confidence": torch.full((pixels.shape[0],), 0.5)})
