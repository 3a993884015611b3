"""The `shapes` reward: the shapes-world verifier through the reward contract and the registry."""

import numpy as np
import pytest
import torch

from diffrl.rewards import MultiReward, build_reward, check_reward_spec
from diffrl.toy.grammar import parse_prompt, scenes
from diffrl.toy.render import corrupt, render


def _batch(prompts: list[str], seed: int = 0, wrong: bool = False) -> torch.Tensor:
    """uint8 [B, 3, 64, 64] renderings of the prompts' scenes (or of a corruption of each)."""
    rng = np.random.default_rng(seed)
    images = []
    for prompt in prompts:
        scene = parse_prompt(prompt)
        images.append(render(corrupt(scene, rng) if wrong else scene, 64, rng))
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


PROMPTS = [
    "a triangle",
    "three circles",
    "a blue square",
    "a circle left of a square",
    "a red circle and a blue square",
]


def test_correct_renderings_score_one_and_corruptions_less():
    reward = build_reward("shapes")
    good = reward(_batch(PROMPTS), PROMPTS, None)  # no metadata: scenes parsed from the prompts
    torch.testing.assert_close(good.scores_B, torch.ones(5))
    torch.testing.assert_close(good.extras["accuracy"], torch.ones(5))
    bad = reward(_batch(PROMPTS, wrong=True), PROMPTS, None)
    assert (bad.scores_B < 1).all() and (bad.extras["accuracy"] == 0).all()
    assert (bad.scores_B > 0).any()  # partial credit: most corruptions break one constraint only
    torch.testing.assert_close(bad.extras["partial"], bad.scores_B)


def test_binary_scores_are_the_accuracy():
    pixels = torch.cat([_batch(PROMPTS[:3]), _batch(PROMPTS[:3], wrong=True)])
    prompts = PROMPTS[:3] * 2
    out = build_reward("shapes", {"score": "binary"})(pixels, prompts, None)
    torch.testing.assert_close(out.scores_B, torch.tensor([1.0, 1, 1, 0, 0, 0]))
    partial = build_reward("shapes")(pixels, prompts, None)
    torch.testing.assert_close(out.extras["partial"], partial.scores_B)


def test_metadata_scene_is_used_over_the_prompt():
    row = {
        "prompt": "free text the grammar does not know",
        "scene": parse_prompt("a green triangle").to_dict(),
    }
    pixels = _batch(["a green triangle", "a green triangle"])
    reward = build_reward("shapes")
    out = reward(
        pixels,
        [row["prompt"]] * 2,
        [{"scene": row["scene"]}, {"scene": parse_prompt("a red triangle").to_dict()}],
    )
    assert out.scores_B[0].item() == 1.0
    assert out.scores_B[1].item() == pytest.approx(2 / 3)  # right shape and count, wrong colour


def test_builtin_rows_score_their_own_renderings():
    rows = [s for s in scenes("heldout")][::6]
    pixels = torch.stack(
        [
            torch.from_numpy(render(s, 64, np.random.default_rng(i))).permute(2, 0, 1)
            for i, s in enumerate(rows)
        ]
    )
    metadata = [{"scene": s.to_dict(), "data_source": s.category} for s in rows]
    out = build_reward("shapes")(pixels, [s.to_prompt() for s in rows], metadata)
    torch.testing.assert_close(out.scores_B, torch.ones(len(rows)))


def test_prompt_outside_the_grammar_is_a_clear_error():
    reward = build_reward("shapes")
    with pytest.raises(ValueError, match="'a photo of a cat' is not a shapes-world prompt"):
        reward(_batch(["a triangle"]), ["a photo of a cat"], None)
    with pytest.raises(ValueError, match="must be a dict"):
        reward(_batch(["a triangle"]), ["a triangle"], [{"scene": "a triangle"}])


def test_arguments_are_checked_before_scoring():
    with pytest.raises(ValueError, match="score='soft' is invalid"):
        build_reward("shapes", {"score": "soft"})
    with pytest.raises(ValueError, match="unknown argument 'mode'"):
        check_reward_spec("shapes", {"mode": "binary"})


def test_works_in_a_multi_reward_and_on_video():
    pixels = _batch(PROMPTS[:2])
    batch = MultiReward({"shapes": {"weight": 2.0}, "shapes@exact": {"args": {"score": "binary"}}})(
        pixels, PROMPTS[:2], None
    )
    torch.testing.assert_close(batch.total_B, torch.full((2,), 3.0))
    assert {"shapes/accuracy", "shapes/partial", "shapes@exact/accuracy"} <= set(batch.extras)
    video = torch.stack([pixels[0], _batch(PROMPTS[:1], wrong=True)[0]]).unsqueeze(0)  # 1 video, 2 frames
    out = build_reward("shapes", {"score": "binary"})(video, PROMPTS[:1], None)
    torch.testing.assert_close(out.scores_B, torch.tensor([0.5]))  # mean over frames
