import math

import numpy as np
import pytest
import torch

from diffrl.algos import get_advantage_estimator, reward_metrics
from diffrl.algos.advantages import compute_flow_grpo_advantages, group_index
from diffrl.config.schema import AlgorithmConfig


def numpy_reference(rewards, uids, norm_adv_by_std, global_std, eps=1e-4):
    """Plain group-by in float64: population std (ddof=0), as the Flow-GRPO reference."""
    r = np.asarray(rewards, dtype=np.float64)
    uids = list(uids)
    out = np.empty_like(r)
    batch_std = np.sqrt(np.mean((r - r.mean()) ** 2))
    for uid in set(uids):
        idx = [i for i, u in enumerate(uids) if u == uid]
        g = r[idx]
        centered = g - g.mean()
        if not norm_adv_by_std:
            out[idx] = centered
        else:
            std = batch_std if global_std else np.sqrt(np.mean(centered**2))
            out[idx] = centered / (std + eps)
    return out


def random_batch(rng, as_str):
    sizes = rng.integers(1, 9, size=int(rng.integers(1, 8)))
    uids = [f"prompt-{g}" if as_str else int(10 * g + 3) for g, n in enumerate(sizes) for _ in range(n)]
    perm = rng.permutation(len(uids))
    uids = [uids[i] for i in perm]
    rewards = rng.normal(loc=rng.normal(), scale=rng.uniform(0.1, 3.0), size=len(uids))
    return rewards, uids


MODES = [
    pytest.param(True, True, id="global_std"),
    pytest.param(True, False, id="group_std"),
    pytest.param(False, True, id="dr_grpo"),
    pytest.param(False, False, id="dr_grpo_group"),
]


@pytest.mark.parametrize(("norm", "global_std"), MODES)
def test_matches_numpy_groupby(norm, global_std):
    cfg = AlgorithmConfig(norm_adv_by_std=norm, global_std=global_std)
    rng = np.random.default_rng(0)
    for trial in range(25):
        rewards, uids = random_batch(rng, as_str=trial % 2 == 0)
        expected = numpy_reference(rewards, uids, norm, global_std)
        got = compute_flow_grpo_advantages(torch.tensor(rewards, dtype=torch.float64), uids, cfg)
        assert got.dtype == torch.float64 and got.shape == (len(uids),)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
        # float32 rewards: same values to float32 precision, float32 out
        got32 = compute_flow_grpo_advantages(torch.tensor(rewards, dtype=torch.float32), uids, cfg)
        assert got32.dtype == torch.float32
        np.testing.assert_allclose(got32.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_hand_case_pins_population_std():
    # rewards 1, 3 (group a) and 5 (group b). Batch mean 3, population variance (4 + 0 + 4) / 3.
    std = math.sqrt(8 / 3)
    adv = compute_flow_grpo_advantages(torch.tensor([1.0, 3.0, 5.0]), ["a", "a", "b"], AlgorithmConfig())
    torch.testing.assert_close(adv, torch.tensor([-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0]))
    # per-group std: group a has population std 1
    adv = compute_flow_grpo_advantages(
        torch.tensor([1.0, 3.0, 5.0]), ["a", "a", "b"], AlgorithmConfig(global_std=False)
    )
    torch.testing.assert_close(adv, torch.tensor([-1 / (1 + 1e-4), 1 / (1 + 1e-4), 0.0]))


@pytest.mark.parametrize(("norm", "global_std"), MODES)
def test_tied_group_gives_zero_and_counts_in_zero_std_ratio(norm, global_std):
    cfg = AlgorithmConfig(norm_adv_by_std=norm, global_std=global_std)
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, 0.1, 0.9, 0.4, 0.3])
    uids = [0, 0, 0, 0, 1, 1, 1, 2]
    adv = compute_flow_grpo_advantages(rewards, uids, cfg)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[7] == 0  # a one-sample group
    assert torch.isfinite(adv).all() and adv[4:7].abs().min() > 0
    assert reward_metrics(rewards, uids)["rewards/zero_std_ratio"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(("norm", "global_std"), MODES)
def test_single_sample_batch_is_zero_not_nan(norm, global_std):
    cfg = AlgorithmConfig(norm_adv_by_std=norm, global_std=global_std)
    adv = compute_flow_grpo_advantages(torch.tensor([3.0]), ["only"], cfg)
    assert torch.equal(adv, torch.zeros(1))


def test_uids_as_tensor_numpy_and_through_the_registry():
    rng = np.random.default_rng(1)
    rewards, uids = random_batch(rng, as_str=False)
    r = torch.tensor(rewards)
    estimator = get_advantage_estimator("flow_grpo")
    ref = estimator(r, uids, AlgorithmConfig())
    torch.testing.assert_close(estimator(r, torch.tensor(uids), AlgorithmConfig()), ref, rtol=0, atol=0)
    torch.testing.assert_close(estimator(r, np.array(uids), AlgorithmConfig()), ref, rtol=0, atol=0)


def test_group_index_is_dense_in_first_appearance_order():
    assert group_index(["b", "a", "b", "c", "a"], 5).tolist() == [0, 1, 0, 2, 1]
    assert group_index([1, "1", 1], 3).tolist() == [0, 1, 0]


def test_errors():
    cfg = AlgorithmConfig()
    with pytest.raises(ValueError, match="got 2 uids for 3 rewards"):
        compute_flow_grpo_advantages(torch.zeros(3), ["a", "b"], cfg)
    with pytest.raises(ValueError, match="one id per sample"):
        compute_flow_grpo_advantages(torch.zeros(3), "abc", cfg)
    with pytest.raises(ValueError, match="1-D"):
        compute_flow_grpo_advantages(torch.zeros(3, 1), ["a", "b", "c"], cfg)
    with pytest.raises(ValueError, match="non-finite values at samples \\[1\\]"):
        compute_flow_grpo_advantages(torch.tensor([0.0, float("nan"), 1.0]), ["a", "a", "b"], cfg)
    with pytest.raises(ValueError, match="hashable"):
        compute_flow_grpo_advantages(torch.zeros(2), [["a"], ["b"]], cfg)
