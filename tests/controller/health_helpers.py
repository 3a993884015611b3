"""Rewards for tests/controller/test_health_run.py (imported by path: `health_helpers:...`)."""

import torch


def prompt_only(pixels, prompts, metadata):
    """A score of the prompt alone: every sample of a prompt group gets the same reward, so every
    group has no reward spread (rewards/zero_std_ratio = 1)."""
    return torch.tensor([len(prompt) / 100 for prompt in prompts])
