"""Source images reach the rewards of an edit run: only the rewards that read them (a `sources`
keyword) get them, each distinct image is decoded once, samples of a prompt share one tensor, a
failing image counts against the rewards that read it, and workers pass them on cheaply."""

import io
import pickle

import numpy as np
import pytest
import reward_test_helpers
import torch
from edit_images import condition_image

from diffrl.data.images import ConditionImage, read_condition_image
from diffrl.rewards import MultiReward, RewardError, build_reward, check_reward_spec
from diffrl.rewards.base import call_reward, decode_sources, needs_sources, takes_sources
from diffrl.workers.reward_workers import InProcessRewardWorkers


@pytest.fixture
def images(tmp_path):
    """Two condition images as the prompt loader makes them: a file (path) and parquet bytes."""
    condition_image(1, 40, 32).save(tmp_path / "a.png")
    buffer = io.BytesIO()
    condition_image(2, 24, 24).save(buffer, format="PNG")
    from_file = read_condition_image("a.png", tmp_path, "edit.jsonl:1", "image")
    from_bytes = read_condition_image(buffer.getvalue(), tmp_path, "edit.parquet row 2", "image")
    return from_file, from_bytes


@pytest.fixture
def loads(monkeypatch):
    """Counts ConditionImage.load calls by key."""
    counts: dict[str, int] = {}
    original = ConditionImage.load

    def counting(self):
        counts[self.key] = counts.get(self.key, 0) + 1
        return original(self)

    monkeypatch.setattr(ConditionImage, "load", counting)
    return counts


def _pixels(batch, size=16):
    return torch.randint(
        0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )


def test_who_takes_sources_is_read_from_the_call():
    assert takes_sources(build_reward("edit_preservation")) and needs_sources(
        build_reward("edit_preservation")
    )
    assert not takes_sources(build_reward("jpeg_compressibility")) and not takes_sources(
        build_reward("shapes")
    )
    http = build_reward("http", {"url": "http://127.0.0.1:1"})
    assert takes_sources(http) and not needs_sources(http)  # sends them when its server reads them
    judge = build_reward("reward_test_helpers:instruction_judge", {"bonus": 1.0})
    assert takes_sources(judge) and needs_sources(judge)  # the python wrapper declares its target's
    counter = build_reward("python", {"function": "reward_test_helpers:SourceCounter", "offset": 2.0})
    assert takes_sources(counter) and not needs_sources(counter)
    plain = build_reward("reward_test_helpers:mean_brightness")
    assert not takes_sources(plain)
    # `sources` is how a reward receives the images, never one of its config args
    check_reward_spec("reward_test_helpers:instruction_judge", {})
    with pytest.raises(ValueError, match=r"unknown argument 'sources'.*It accepts: bonus"):
        check_reward_spec("reward_test_helpers:instruction_judge", {"sources": 1})


def test_only_the_rewards_that_read_sources_get_them_each_image_decoded_once(images, loads):
    a, b = images
    reward_test_helpers.SOURCES_SEEN.clear()
    rewards = MultiReward(
        {
            "reward_test_helpers:instruction_judge": {},
            "python@counter": {"args": {"function": "reward_test_helpers:SourceCounter"}},
            "reward_test_helpers:mean_brightness": {},  # takes no sources: called as before
            "edit_preservation": {},
        }
    )
    prompts = ["make it darker", "make it darker", "make it brighter now", "make it brighter now"]
    out = rewards(_pixels(4), prompts, None, [(a,), (a,), (b,), (b,)])
    assert loads == {a.key: 1, b.key: 1}  # two prompts of two samples: each image decoded once
    (seen,) = reward_test_helpers.SOURCES_SEEN
    assert seen[0][0] is seen[1][0] and seen[2][0] is seen[3][0]  # a prompt's samples share its tensor
    expected = [
        torch.from_numpy(np.array(condition_image(s, *wh))).permute(2, 0, 1)
        for s, wh in ((1, (40, 32)), (2, (24, 24)))
    ]
    assert torch.equal(seen[0][0], expected[0]) and torch.equal(seen[2][0], expected[1])
    assert seen[0][0].dtype == torch.uint8 and seen[0][0].shape == (3, 32, 40)  # its own size
    assert out.extras["reward_test_helpers:instruction_judge/source_height"].tolist() == [32, 32, 24, 24]
    assert out.scores["python@counter"].tolist() == [1.0] * 4
    assert out.scores["edit_preservation"].shape == (4,)

    # the next micro-batch: b's prompt goes on (its decode is reused), a new prompt of a
    rewards(_pixels(2), prompts[2:], None, [(b,), (b,)])
    assert loads == {a.key: 1, b.key: 1}
    rewards(_pixels(1), prompts[:1], None, [(a,)])  # a was not in the last batch: decoded again
    assert loads == {a.key: 2, b.key: 1} and set(rewards._decoded) == {a.key}  # only this batch's kept

    # a non-edit micro-batch (no sources): the reader gets None, the others are unchanged
    out = MultiReward({"python@c": {"args": {"function": "reward_test_helpers:SourceCounter"}}})(
        _pixels(2), ["x", "y"], None
    )
    assert out.scores["python@c"].tolist() == [-1.0, -1.0]


def test_sources_are_never_decoded_for_rewards_that_do_not_read_them(images, loads, monkeypatch):
    a, _ = images
    rewards = MultiReward({"jpeg_compressibility": {}, "shapes": {}})
    rewards(_pixels(2, 32), ["a red circle", "a red circle"], None, [(a,), (a,)])
    assert loads == {}


def test_an_image_that_fails_to_load_fails_only_the_rewards_that_read_it(images, monkeypatch):
    a, _ = images

    def gone(self):
        raise FileNotFoundError(f"condition image {self.name} not found")

    monkeypatch.setattr(ConditionImage, "load", gone)
    rewards = MultiReward({"jpeg_compressibility": {}, "edit_preservation": {"required": False}})
    out = rewards(_pixels(2), ["x", "x"], None, [(a,), (a,)])
    assert out.failed["edit_preservation"].all() and not out.failed["jpeg_compressibility"].any()
    torch.testing.assert_close(out.total_B, out.scores["jpeg_compressibility"])
    with pytest.raises(
        RewardError,
        match=r"required reward 'edit_preservation' failed.*FileNotFoundError: condition image a\.png not found",
    ):
        MultiReward({"edit_preservation": {}})(_pixels(2), ["x", "x"], None, [(a,), (a,)])


def test_decode_sources_checks_the_rows(images):
    a, _ = images
    good = torch.zeros(3, 8, 8, dtype=torch.uint8)
    assert decode_sources([(good,), ()], 2)[0][0] is good  # tensors pass as they are; a row may be empty
    with pytest.raises(ValueError, match=r"sources must be B=2 rows \(one per sample\), got 1 rows"):
        decode_sources([(a,)], 2)
    with pytest.raises(
        ValueError, match=r"sources\[0\]\[0\] must be a uint8 \[3, H, W\] RGB image, got torch.float32"
    ):
        decode_sources([(good.float(),)], 1)
    with pytest.raises(
        ValueError, match=r"sources\[0\]\[0\] must be a uint8 \[3, H, W\] tensor or a ConditionImage"
    ):
        decode_sources([("a.png",)], 1)
    with pytest.raises(ValueError, match=r"sources\[0\] must be a tuple"):
        decode_sources(["a.png"], 1)
    # call_reward hands a reader None when there are no sources, and a non-reader nothing
    out = call_reward(
        build_reward("python", {"function": "reward_test_helpers:SourceCounter"}),
        _pixels(1),
        ["x"],
        [{}],
        "c",
    )
    assert out.scores_B.tolist() == [-1.0]


def test_workers_pass_sources_on_and_a_prompts_image_pickles_once(images):
    a, b = images
    with InProcessRewardWorkers({"edit_preservation": {}}, overlap=True) as workers:
        handle = workers.submit(_pixels(2), ["x", "y"], None, sources=[(b,), (b,)])
        assert handle.result(timeout=30).scores["edit_preservation"].shape == (2,)
        # a non-edit submit, as before (no sources keyword)
        with pytest.raises(RewardError, match=r"this batch has none"):
            workers.submit(_pixels(1), ["x"], None).result(timeout=30)
    # Ray sends the rows pickled: the samples of a prompt share the ConditionImage, whose encoded
    # bytes are then written once, not once per sample
    one = len(pickle.dumps([(b,)], protocol=5))
    many = len(pickle.dumps([(b,)] * 16, protocol=5))
    assert b.data is not None and many < one + 16 * 16 < 2 * len(b.data)
    assert len(pickle.dumps([(a,)] * 16, protocol=5)) < 1000  # a file travels as its path
