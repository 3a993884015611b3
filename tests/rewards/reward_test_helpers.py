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


# ------------------------------------------------------------------ edit runs: rewards that read sources
SOURCES_SEEN: list = []


def instruction_judge(pixels, prompts, metadata, *, sources, bonus=0.0):
    """A tiny stand-in for a VLM judge of edits: it reads the instruction, the source and the
    result. Score: the instruction's word count + 1 when the result's mean brightness moved in the
    direction the instruction names ("brighter"/"darker") relative to the source, + `bonus`.
    Extras echo what arrived (source sizes and sums), so a test sees it came through unchanged."""
    SOURCES_SEEN.append(sources)
    scores, sums, heights = [], [], []
    for result, prompt, row in zip(pixels, prompts, sources, strict=True):
        source = row[0]
        moved = result.float().mean() - source.float().mean()
        wanted = 1.0 if "brighter" in prompt else -1.0 if "darker" in prompt else 0.0
        scores.append(len(prompt.split()) + float(wanted * moved > 0) + bonus)
        sums.append(float(sum(int(s.sum()) for s in row)))
        heights.append(int(source.shape[1]))
    return RewardOutput(
        torch.tensor(scores), {"source_sum": torch.tensor(sums), "source_height": torch.tensor(heights)}
    )


class SourceCounter:
    """A class reward that takes optional sources: how many it got per sample (0 without)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self, pixels, prompts, metadata, sources=None):
        if sources is None:
            return torch.full((pixels.shape[0],), self.offset - 1.0)
        return torch.tensor([len(row) + self.offset for row in sources], dtype=torch.float32)
