"""Frame-sampled video rewards: `reward.functions.<name>.video_frames=K` scores K evenly spaced frames
(the first and the last among them) and averages, checked against hand computations."""

import pytest
import torch

from diffrl.config import ConfigError, RewardFnConfig, load_config
from diffrl.rewards import MultiReward, RewardOutput, build_reward
from diffrl.rewards.base import ImageReward, call_reward, frame_indices, select_frames


class MeanBrightness(ImageReward):
    """Mean pixel value of a frame / 255: known in closed form for frames of one grey level."""

    name = "mean_brightness"

    def score_images(self, frames_N3HW, prompts_N, metadata_N):
        return RewardOutput(frames_N3HW.float().mean(dim=(1, 2, 3)) / 255.0)


def grey_video(levels_BT: list[list[int]], size: int = 4) -> torch.Tensor:
    """[B, T, 3, size, size] uint8 videos whose frame t of sample b is all `levels_BT[b][t]`."""
    levels = torch.tensor(levels_BT, dtype=torch.uint8)
    return levels[:, :, None, None, None].expand(*levels.shape, 3, size, size).contiguous()


@pytest.mark.parametrize(
    ("frames", "count", "expected"),
    [
        # i_k = round(k (T-1) / (K-1)): 32/3 = 10.67 -> 11, 64/3 = 21.33 -> 21
        (33, 4, [0, 11, 21, 32]),
        (33, 2, [0, 32]),
        (5, 3, [0, 2, 4]),
        (4, 3, [0, 2, 3]),  # 1.5 rounds up
        (81, 5, [0, 20, 40, 60, 80]),
        (5, 5, [0, 1, 2, 3, 4]),
        (5, 8, [0, 1, 2, 3, 4]),  # more asked than there are: every frame
        (5, None, [0, 1, 2, 3, 4]),
    ],
)
def test_frame_indices_by_hand(frames, count, expected):
    assert frame_indices(frames, count) == expected


def test_frame_indices_are_distinct_and_span_the_video():
    for frames in range(2, 40):
        for count in range(2, frames + 1):
            index = frame_indices(frames, count)
            assert len(set(index)) == count and index[0] == 0 and index[-1] == frames - 1
            assert index == sorted(index)


def test_brightness_of_four_of_33_frames_is_the_hand_mean():
    levels = [[(7 * t + 3 * b) % 256 for t in range(33)] for b in range(2)]
    pixels = grey_video(levels)
    out = call_reward(MeanBrightness(), pixels, ["a", "b"], [{}, {}], "mean_brightness", video_frames=4)
    # frames 0, 11, 21, 32 of each sample
    hand = [sum(row[t] for t in (0, 11, 21, 32)) / 4 / 255 for row in levels]
    torch.testing.assert_close(out.scores_B, torch.tensor(hand, dtype=torch.float32))
    every = call_reward(MeanBrightness(), pixels, ["a", "b"], [{}, {}], "mean_brightness")
    torch.testing.assert_close(every.scores_B, torch.tensor([sum(r) / 33 / 255 for r in levels]))


def test_multi_reward_applies_each_entry_its_own_frames():
    levels = [[0, 10, 20, 30, 255], [100, 0, 0, 0, 50]]
    pixels = grey_video(levels)
    functions = {
        # a function reward by import path: it sees the [B, K, 3, H, W] frames it is given
        "reward_test_helpers:mean_brightness": RewardFnConfig(video_frames=2),
        "jpeg_compressibility": {"weight": 0.0, "video_frames": 3},
        "jpeg_compressibility@all": {"weight": 0.0},
    }
    batch = MultiReward(functions)(pixels, ["a", "b"], None)
    torch.testing.assert_close(
        batch.scores["reward_test_helpers:mean_brightness"],
        torch.tensor([(0 + 255) / 2 / 255, (100 + 50) / 2 / 255]),
    )
    # an image reward on 3 of 5 frames = the mean of its image scores on frames 0, 2, 4
    jpeg = build_reward("jpeg_compressibility")
    on_frames = torch.stack([jpeg(pixels[:, t], ["a", "b"], None).scores_B for t in (0, 2, 4)])
    torch.testing.assert_close(batch.scores["jpeg_compressibility"], on_frames.mean(dim=0))
    on_all = torch.stack([jpeg(pixels[:, t], ["a", "b"], None).scores_B for t in range(5)])
    torch.testing.assert_close(batch.scores["jpeg_compressibility@all"], on_all.mean(dim=0))


def test_images_pass_through():
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    assert select_frames(images, 2) is images


@pytest.mark.parametrize("bad", [1, 0, -3])
def test_a_bad_frame_count_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"reward.functions.jpeg_compressibility.video_frames=.*>= 2"):
        load_config("tiny_sd3", [f"reward.functions.jpeg_compressibility.video_frames={bad}"])


def test_unknown_entry_keys_list_video_frames():
    with pytest.raises(ValueError, match="video_frames"):
        MultiReward({"jpeg_compressibility": {"video_frame": 2}})
