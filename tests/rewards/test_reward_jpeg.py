"""JPEG (in)compressibility: sizes ordered as image content dictates; one is the other's negation."""

import io

import pytest
import torch
from PIL import Image

from diffrl.rewards import build_reward


def _images():
    generator = torch.Generator().manual_seed(0)
    flat = torch.full((3, 64, 64), 128, dtype=torch.uint8)
    ramp = torch.linspace(0, 255, 64).round().to(torch.uint8).expand(3, 64, 64).contiguous()
    noise = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=generator)
    return torch.stack([flat, ramp, noise])


def test_flat_compresses_better_than_noise():
    scores = build_reward("jpeg_compressibility")(_images(), ["p"] * 3, None).scores_B
    flat, ramp, noise = scores.tolist()
    assert flat > ramp > noise  # compressibility: fewer kB scores higher
    assert noise < -5.0 < flat  # 64x64 noise at q=95 is well over 5 kB; a flat image ~1 kB


def test_incompressibility_is_the_negation_and_sizes_are_kilobytes():
    images = _images()
    inc = build_reward("jpeg_incompressibility")(images, ["p"] * 3, None)
    comp = build_reward("jpeg_compressibility")(images, ["p"] * 3, None)
    assert torch.equal(inc.scores_B, -comp.scores_B)
    # Independent expectation: Pillow's own JPEG byte count at quality 95, divided by 1000.
    for image, score in zip(images, inc.scores_B, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=95)
        assert score.item() == pytest.approx(len(buffer.getvalue()) / 1000, rel=1e-6)
    assert torch.equal(inc.extras["jpeg_kb"], inc.scores_B)


def test_lower_quality_makes_smaller_files():
    noise = _images()[2:]
    high = build_reward("jpeg_incompressibility", {"quality": 95})(noise, ["p"], None).scores_B
    low = build_reward("jpeg_incompressibility", {"quality": 10})(noise, ["p"], None).scores_B
    assert low.item() < high.item()


def test_video_scores_are_the_mean_over_frames():
    images = _images()
    video = images.unsqueeze(0)  # one video of 3 frames: [1, 3, 3, 64, 64]
    reward = build_reward("jpeg_incompressibility")
    per_frame = reward(images, ["p"] * 3, None).scores_B
    out = reward(video, ["p"], None)
    assert out.scores_B.shape == (1,)
    torch.testing.assert_close(out.scores_B, per_frame.mean().reshape(1))
