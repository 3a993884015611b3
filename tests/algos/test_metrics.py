import pytest
import torch

from diffrl.algos import advantage_metrics, reward_metrics


def test_reward_metrics_hand_case():
    # groups: a = (1, 1, 1) ties; b = (0, 2) population std 1; c = (5,) a single sample (ties).
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0, 2.0, 1.0])
    uids = ["a", "b", "a", "c", "b", "a"]
    assert reward_metrics(rewards, uids) == {
        "rewards/mean": pytest.approx(10 / 6),
        "rewards/max": 5.0,
        "rewards/min": 0.0,
        "rewards/zero_std_ratio": pytest.approx(2 / 3),
        "rewards/std_mean": pytest.approx(1 / 3),
        "rewards/group_size": 2.0,
    }


def test_float_ties_count_even_when_rounding_leaves_a_tiny_std():
    # mean(0.1, 0.1, 0.1) rounds to 0.10000000000000002, so the computed std is ~1e-17, not 0
    m = reward_metrics(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), [7, 7, 7])
    assert m["rewards/zero_std_ratio"] == 1.0
    assert m["rewards/std_mean"] == pytest.approx(0.0, abs=1e-15)


def test_prefix_and_plain_floats():
    m = reward_metrics(torch.tensor([1.0, 2.0]), [0, 1], prefix="rewards/ocr")
    assert set(m) == {
        f"rewards/ocr/{k}" for k in ("mean", "max", "min", "zero_std_ratio", "std_mean", "group_size")
    }
    assert all(type(v) is float for v in m.values())


def test_advantage_metrics_over_all_elements():
    adv = torch.tensor([[1.0, 1.0], [-3.0, -3.0], [0.5, 0.5]])  # (B, T) broadcast over steps
    assert advantage_metrics(adv) == {
        "advantages/mean": pytest.approx(-0.5),
        "advantages/max": 1.0,
        "advantages/min": -3.0,
    }


def test_errors():
    with pytest.raises(ValueError, match="got 1 uids for 2 rewards"):
        reward_metrics(torch.zeros(2), ["a"])
    with pytest.raises(ValueError, match="non-empty"):
        reward_metrics(torch.zeros(0), [])
    with pytest.raises(ValueError, match="non-empty"):
        advantage_metrics(torch.zeros(0))
