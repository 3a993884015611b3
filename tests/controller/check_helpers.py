"""Rewards for tests/controller/test_check.py's broken setups (imported by path: `check_helpers:...`)."""

import torch


def one_short(pixels, prompts, metadata):
    """A reward that drops the last sample's score: one score fewer than samples."""
    return torch.zeros(len(prompts) - 1)


def not_finite(pixels, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))
