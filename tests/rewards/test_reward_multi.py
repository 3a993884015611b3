"""Multi-reward: weighted sum, per-reward metrics, required vs optional failures."""

import logging

import pytest
import torch

from diffrl.algos.metrics import reward_metrics
from diffrl.config import RewardFnConfig
from diffrl.rewards import (
    REWARDS,
    MultiReward,
    RewardBatch,
    RewardError,
    build_reward,
    register_reward,
    reward_specs,
)

FLAKY = "reward_test_helpers:fails_when_asked"


def _pixels(batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, 16, 16), dtype=torch.uint8, generator=generator)


def test_weighted_sum_of_rewards_from_config_objects():
    functions = {
        "jpeg_compressibility": RewardFnConfig(weight=0.5),
        "reward_test_helpers:Constant": RewardFnConfig(weight=3.0, args={"value": 2.0}),
    }
    pixels = _pixels(3)
    batch = MultiReward(functions)(pixels, ["a", "b", "c"], None)
    jpeg = build_reward("jpeg_compressibility")(pixels, ["a", "b", "c"], None).scores_B
    torch.testing.assert_close(batch.scores["jpeg_compressibility"], jpeg)
    torch.testing.assert_close(batch.scores["reward_test_helpers:Constant"], torch.full((3,), 2.0))
    torch.testing.assert_close(batch.total_B, 0.5 * jpeg + 3.0 * 2.0)
    assert set(batch.extras) == {"jpeg_compressibility/jpeg_kb"}
    assert batch.failed_batches == {"jpeg_compressibility": 0, "reward_test_helpers:Constant": 0}


def test_required_failure_stops_with_the_rewards_name():
    reward = MultiReward(
        {"jpeg_compressibility": {"weight": 1.0}, "reward_test_helpers:always_fails": {"required": True}}
    )
    with pytest.raises(
        RewardError,
        match=r"required reward 'reward_test_helpers:always_fails' failed on a "
        r"micro-batch of 2 sample\(s\): RuntimeError: scorer exploded.*"
        r"reward.functions.reward_test_helpers:always_fails.required=false",
    ) as info:
        reward(_pixels(), ["a", "b"], None)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_optional_failure_scores_zero_is_counted_and_logged(caplog):
    reward = MultiReward(
        {
            "jpeg_incompressibility": {"weight": 1.0},
            FLAKY: {"weight": 10.0, "required": False},
            "reward_test_helpers:returns_nan": {"weight": 1.0, "required": False},
        }
    )
    uids = ["p0", "p0", "p1", "p1"]
    with caplog.at_level(logging.WARNING, logger="diffrl.rewards.multi"):
        ok = reward(_pixels(2, seed=1), ["a", "a"], [{}, {}])
        bad = reward(_pixels(2, seed=2), ["b", "b"], [{"fail": True}, {}])
    assert f"reward '{FLAKY}' failed on a micro-batch of 2 sample(s); they score 0" in caplog.text
    assert "ConnectionError: remote scorer hiccup" in caplog.text
    assert "non-finite scores" in caplog.text  # NaN scores are a failure, not a number
    jpeg_ok, jpeg_bad = ok.scores["jpeg_incompressibility"], bad.scores["jpeg_incompressibility"]
    torch.testing.assert_close(ok.total_B, jpeg_ok + 10.0)
    torch.testing.assert_close(bad.total_B, jpeg_bad)  # the flaky reward contributes 0
    assert bad.scores[FLAKY].tolist() == [0.0, 0.0] and bad.failed[FLAKY].all()

    step = RewardBatch.concat([ok, bad])
    assert len(step) == 4
    assert step.failed_batches == {
        "jpeg_incompressibility": 0,
        FLAKY: 1,
        "reward_test_helpers:returns_nan": 2,
    }
    assert step.extras[f"{FLAKY}/confidence"][:2].tolist() == [0.5, 0.5]
    assert step.extras[f"{FLAKY}/confidence"][2:].isnan().all()  # extras of a failed batch are NaN

    metrics = step.metrics(uids)
    assert {
        k: v for k, v in metrics.items() if k.startswith("rewards/") and k.count("/") == 1
    } == reward_metrics(step.total_B, uids)
    flaky = "rewards/reward_test_helpers_fails_when_asked"
    assert metrics[f"{flaky}/mean"] == pytest.approx(0.5)
    assert metrics[f"{flaky}/failed_batches"] == 1.0
    assert metrics[f"{flaky}/failed_fraction"] == 0.5
    assert metrics[f"{flaky}/confidence_mean"] == pytest.approx(0.5)  # NaN-filled entries ignored
    assert metrics["rewards/reward_test_helpers_returns_nan/failed_fraction"] == 1.0
    assert metrics["rewards/jpeg_incompressibility/mean"] == pytest.approx(
        torch.cat([jpeg_ok, jpeg_bad]).double().mean().item()
    )
    assert metrics["rewards/jpeg_incompressibility/jpeg_kb_mean"] == pytest.approx(
        metrics["rewards/jpeg_incompressibility/mean"]
    )
    assert metrics["rewards/jpeg_incompressibility/seconds"] > 0


def test_config_errors_before_any_model_loads():
    with pytest.raises(ValueError, match=r"reward.functions is empty"):
        reward_specs({})
    with pytest.raises(ValueError, match=r"unknown reward 'ocrr'. Did you mean 'ocr'"):
        reward_specs({"ocrr": {}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['wieght'\]"):
        reward_specs({"ocr": {"wieght": 1.0}})
    with pytest.raises(ValueError, match=r"weight=nan is invalid"):
        reward_specs({"ocr": {"weight": float("nan")}})
    for name in ("multi_test_ones", "multi_test_ones_a"):
        if name not in REWARDS:
            register_reward(name)(lambda pixels, prompts, metadata: torch.ones(pixels.shape[0]))
    with pytest.raises(ValueError, match=r"would log under the same metric name rewards/multi_test_ones_a"):
        reward_specs({"jpeg_compressibility@a": {}, "multi_test_ones_a": {}, "multi_test_ones@a": {}})


def test_build_failure_names_the_entry():
    with pytest.raises(FileNotFoundError) as info:
        MultiReward({"clip_score": {"args": {"model": "/no/such/dir"}}})
    assert "while building reward.functions.clip_score" in "\n".join(info.value.__notes__)


def test_select_keeps_the_per_sample_rows_of_a_concatenated_batch():
    reward = MultiReward({"jpeg_compressibility": {"weight": 2.0}})
    first, second = (
        reward(_pixels(2, seed=1), ["a", "b"], None),
        reward(_pixels(3, seed=2), ["c", "d", "e"], None),
    )
    whole = RewardBatch.concat([first, second])
    tail = whole.select(slice(2, 5))
    torch.testing.assert_close(tail.total_B, second.total_B)
    torch.testing.assert_close(tail.scores["jpeg_compressibility"], second.scores["jpeg_compressibility"])
    torch.testing.assert_close(
        tail.extras["jpeg_compressibility/jpeg_kb"], second.extras["jpeg_compressibility/jpeg_kb"]
    )
    assert len(tail) == 3 and tail.failed_batches == whole.failed_batches
