"""The `shapes_edit` reward: the edit verifier through the reward contract and the registry."""

import json

import numpy as np
import pytest
import torch

from diffrl.rewards import MultiReward, build_reward, check_reward_spec
from diffrl.toy.edit import builtin_edit_path, render_placed

ROWS = [json.loads(line) for line in builtin_edit_path("heldout").read_text(encoding="utf-8").splitlines()][
    ::8
]


def _pixels(which: str) -> torch.Tensor:
    from diffrl.toy.edit import EditExample

    images = [render_placed(getattr(EditExample.from_dict(r["edit"]), which), 32) for r in ROWS]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def _metadata() -> list[dict]:
    return [{k: v for k, v in r.items() if k != "prompt"} for r in ROWS]


def test_targets_score_one_and_sources_zero():
    prompts = [r["prompt"] for r in ROWS]
    reward = build_reward("shapes_edit")
    good = reward(_pixels("target"), prompts, _metadata())
    torch.testing.assert_close(good.scores_B, torch.ones(len(ROWS)))
    for name in ("accuracy", "partial", "edit", "keep"):
        torch.testing.assert_close(good.extras[name], torch.ones(len(ROWS)))
    copy = reward(_pixels("source"), prompts, _metadata())
    torch.testing.assert_close(copy.scores_B, torch.zeros(len(ROWS)))
    torch.testing.assert_close(copy.extras["keep"], torch.ones(len(ROWS)))
    torch.testing.assert_close(copy.extras["edit"], torch.zeros(len(ROWS)))


def test_binary_scores_are_the_accuracy():
    pixels = torch.cat([_pixels("target")[:3], torch.full((3, 3, 32, 32), 255, dtype=torch.uint8)])
    out = build_reward("shapes_edit", {"score": "binary"})(
        pixels, [r["prompt"] for r in ROWS[:3]] * 2, _metadata()[:3] * 2
    )
    torch.testing.assert_close(out.scores_B, torch.tensor([1.0, 1, 1, 0, 0, 0]))


def test_in_a_multi_reward_logs_the_extras():
    reward = MultiReward({"shapes_edit": {"weight": 2.0}})
    out = reward(_pixels("target"), [r["prompt"] for r in ROWS], _metadata())
    assert out.total_B.tolist() == [2.0] * len(ROWS)
    assert out.extras["shapes_edit/keep"].tolist() == [1.0] * len(ROWS)
    assert {r["data_source"] for r in ROWS} == {"recolor", "reshape", "add", "remove", "move"}


def test_errors_name_the_fix():
    check_reward_spec("shapes_edit", {"score": "binary"})
    with pytest.raises(ValueError, match="score='exact' is invalid"):
        build_reward("shapes_edit", {"score": "exact"})
    pixels = _pixels("target")[:1]
    with pytest.raises(ValueError, match=r"has no 'edit' field.*builtin:shapes_edit_train\.jsonl"):
        build_reward("shapes_edit")(pixels, ["make the circle red"], [{}])
    with pytest.raises(ValueError, match="'edit' of prompt 'x' is invalid"):
        build_reward("shapes_edit")(pixels, ["x"], [{"edit": {"kind": "recolor"}}])
