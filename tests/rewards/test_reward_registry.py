"""The reward registry, spec syntax, argument checks, the batch contract and user functions by path."""

import pytest
import torch

import diffrl.rewards as rewards
from diffrl.rewards import RewardOutput, build_reward, check_reward_spec, reward_names
from diffrl.rewards.base import as_reward_output, check_batch
from diffrl.rewards.registry import REWARDS, base_name, metric_name


def _pixels(batch=2, size=8, value=0):
    return torch.full((batch, 3, size, size), value, dtype=torch.uint8)


def test_builtins_are_registered():
    assert {
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "ocr",
        "clip_score",
        "pickscore",
        "aesthetic",
        "http",
        "python",
    } <= set(reward_names())


def test_unknown_name_lists_registered_and_suggests():
    with pytest.raises(
        ValueError,
        match=r"unknown reward 'jpeg_compresibility'\. Did you mean 'jpeg_compressibility'\?.*Registered: .*ocr",
    ):
        build_reward("jpeg_compresibility")


def test_unknown_and_missing_args_are_named():
    with pytest.raises(
        ValueError, match=r"unknown argument 'qualty'.*Did you mean 'quality'\?.*accepts: quality"
    ):
        check_reward_spec("jpeg_compressibility", {"qualty": 90})
    with pytest.raises(
        ValueError, match=r"needs argument\(s\) model: set reward.functions.clip_score.args.model"
    ):
        check_reward_spec("clip_score", {})
    with pytest.raises(ValueError, match=r"quality=200 is invalid: must be an integer in 1..95"):
        build_reward("jpeg_compressibility", {"quality": 200})


def test_label_and_import_path_specs():
    assert base_name("http@ocr") == "http"
    assert base_name("pkg.mod:fn") == "python"
    assert metric_name("http@ocr") == "http_ocr"
    assert metric_name("pkg.mod:fn") == "pkg.mod_fn"
    for bad in ("@x", "http@", "http@a/b"):
        with pytest.raises(ValueError, match=r"NAME@LABEL"):
            base_name(bad)
    a = build_reward("jpeg_compressibility@a", {"quality": 50})
    assert a.quality == 50


def test_register_rejects_taken_and_reserved_names():
    with pytest.raises(ValueError, match=r"already registered"):
        rewards.register_reward("ocr")(lambda pixels, prompts, metadata: None)
    with pytest.raises(ValueError, match=r"must not contain"):
        rewards.register_reward("a@b")


def test_registered_function_gets_args_bound():
    name = "test_registry_scaled_ones"
    if name not in REWARDS:

        @rewards.register_reward(name)
        def scaled_ones(pixels, prompts, metadata, *, scale=1.0):
            return torch.full((pixels.shape[0],), scale)

    reward = build_reward(name, {"scale": 3.0})
    assert reward(_pixels(), ["a", "b"], [{}, {}]).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match=r"unknown argument 'scael'"):
        build_reward(name, {"scael": 1})


def test_check_batch_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"must be uint8"):
        check_batch(torch.zeros(1, 3, 4, 4), ["a"], [{}])
    with pytest.raises(ValueError, match=r"shape \[B, 3, H, W\].*got \(1, 4, 4\)"):
        check_batch(torch.zeros(1, 4, 4, dtype=torch.uint8), ["a"], [{}])
    with pytest.raises(ValueError, match=r"list of B=2 strings"):
        check_batch(_pixels(2), ["a"], [{}, {}])
    with pytest.raises(ValueError, match=r"list of B=2 dicts"):
        check_batch(_pixels(2), ["a", "b"], [{}])
    assert check_batch(_pixels(2), ["a", "b"], None) == [{}, {}]
    video = torch.zeros(2, 5, 3, 4, 4, dtype=torch.uint8)
    assert len(check_batch(video, ["a", "b"], [{}, {}])) == 2


def test_as_reward_output_validates():
    out = as_reward_output([1, 2], 2, "r")
    assert out.scores_B.dtype == torch.float32 and out.scores_B.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"reward 'r' returned scores of shape \(3,\); expected \(2,\)"):
        as_reward_output(torch.zeros(3), 2, "r")
    with pytest.raises(ValueError, match=r"non-finite scores for samples \[1\]"):
        as_reward_output([0.0, float("inf")], 2, "r")
    with pytest.raises(ValueError, match=r"extra 'e' has shape"):
        as_reward_output(RewardOutput(torch.zeros(2), {"e": torch.zeros(3)}), 2, "r")


# ------------------------------------------------------------------------------- user functions
def test_user_function_by_import_path_sync():
    pixels = torch.stack(
        [torch.full((3, 4, 4), 0, dtype=torch.uint8), torch.full((3, 4, 4), 255, dtype=torch.uint8)]
    )
    reward = build_reward("reward_test_helpers:mean_brightness", {"scale": 2.0})
    assert reward(pixels, ["a", "b"], [{}, {}]).scores_B.tolist() == [0.0, 2.0]
    same = build_reward("python", {"function": "reward_test_helpers:mean_brightness", "scale": 2.0})
    assert same(pixels, ["a", "b"], None).scores_B.tolist() == [0.0, 2.0]


def test_user_function_by_import_path_async():
    reward = build_reward("reward_test_helpers:async_prompt_length")
    out = reward(_pixels(2), ["a cat", "two red dogs"], [{}, {}])
    assert out.scores_B.tolist() == [5.0, 12.0]
    assert out.extras["words"].tolist() == [2, 3]


def test_async_user_function_inside_a_running_event_loop():
    import asyncio

    reward = build_reward("reward_test_helpers:async_prompt_length")

    async def main():
        return reward(_pixels(1), ["abc"], [{}])

    assert asyncio.run(main()).scores_B.tolist() == [3.0]


def test_user_class_by_import_path_is_constructed_once_with_args():
    reward = build_reward("reward_test_helpers:Constant", {"value": 0.25})
    assert reward(_pixels(3), ["a", "b", "c"], None).scores_B.tolist() == [0.25] * 3


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "reward_test_helpers.mean_brightness",
            "unknown reward.*For a function by import path write 'module:function'",
        ),
        ("reward_test_helpers:mean-brightness", "not an import path: expected 'module:function'"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'.*no such module.*PYTHONPATH"),
        (
            "reward_test_helpers:mean_brightnes",
            "has no attribute 'mean_brightnes'.*Did you mean 'mean_brightness'",
        ),
        ("reward_test_helpers:NOT_CALLABLE", "is a int, not a function or class"),
    ],
)
def test_bad_import_paths(path, message):
    with pytest.raises(ValueError, match=message):
        build_reward(path)


def test_user_function_args_checked_and_bad_output_rejected():
    with pytest.raises(ValueError, match=r"unknown argument 'scal'.*Did you mean 'scale'"):
        build_reward("reward_test_helpers:mean_brightness", {"scal": 1})
    with pytest.raises(ValueError, match=r"drop args.function"):
        build_reward("reward_test_helpers:mean_brightness", {"function": "x:y"})
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        build_reward("reward_test_helpers:wrong_shape")(_pixels(2), ["a", "b"], None)
