"""`edit_preservation` against an independent NumPy computation and closed forms, its behaviour on
identical, unrelated and locally edited images, and an edit run's rewards combined (the
instruction-following kinds, OCR and the shapes verifier, read the instruction as the prompt)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from edit_images import condition_image
from PIL import Image, ImageDraw, ImageFont

from diffrl.rewards import MultiReward, build_reward
from diffrl.rewards.base import call_reward
from diffrl.toy.grammar import parse_prompt
from diffrl.toy.render import render

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")  # as test_reward_ocr


def _chw(array_HW3: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array_HW3)).permute(2, 0, 1).contiguous()


def _numpy_preservation(result_HW3: np.ndarray, source_HW3: np.ndarray, tau: float) -> float:
    """The documented formula, written again in NumPy (float64) for same-size images."""
    d = np.abs(result_HW3.astype(np.float64) - source_HW3.astype(np.float64)).mean(axis=2)
    return float(np.maximum(0.0, 1.0 - d / tau).mean())


def _score(pixels, sources, **args):
    reward = build_reward("edit_preservation", args)
    batch = int(pixels.shape[0])
    return call_reward(reward, pixels, ["edit"] * batch, [{}] * batch, "edit_preservation", sources=sources)


@pytest.mark.parametrize("tau", [8.0, 32.0, 200.0])
def test_matches_an_independent_numpy_computation(tau):
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    # results from identical to unrelated: the source plus noise of growing size
    results = [
        np.clip(source.astype(int) + rng.integers(-s, s + 1, source.shape), 0, 255).astype(np.uint8)
        for s in (0, 4, 30, 255)
    ]
    pixels = torch.stack([_chw(r) for r in results])
    out = _score(pixels, [(_chw(source),)] * len(results), threshold=tau)
    expected = [_numpy_preservation(r, source, tau) for r in results]
    np.testing.assert_allclose(out.scores_B.numpy(), expected, rtol=0, atol=1e-6)
    mean_abs = [np.abs(r.astype(float) - source).mean() / 255 for r in results]
    np.testing.assert_allclose(out.extras["mean_abs_diff"].numpy(), mean_abs, atol=1e-6)
    kept = [(np.abs(r.astype(float) - source).mean(axis=2) < tau).mean() for r in results]
    np.testing.assert_allclose(out.extras["kept_fraction"].numpy(), kept, atol=1e-6)


def test_closed_forms_offset_and_local_edit():
    source = np.full((32, 32, 3), 100, np.uint8)
    # every pixel off by k < tau in every channel: 1 - k / tau exactly
    shifted = source + 8
    # a square of a quarter of the image changed by >= tau, the rest untouched: 1 - 1/4
    edited = source.copy()
    edited[:16, :16] = 250
    # both: the quarter costs 1/4, the rest 8/32 of its 3/4
    both = shifted.copy()
    both[:16, :16] = 250
    pixels = torch.stack([_chw(shifted), _chw(edited), _chw(both)])
    out = _score(pixels, [(_chw(source),)] * 3, threshold=32)
    torch.testing.assert_close(out.scores_B, torch.tensor([1 - 8 / 32, 0.75, 0.75 * (1 - 8 / 32)]))
    torch.testing.assert_close(out.extras["kept_fraction"], torch.tensor([1.0, 0.75, 0.75]))


def test_a_source_of_another_size_is_resized_to_the_result():
    """The source is resized (bilinear, antialiased) to the result's size: against Pillow's own
    antialiased bilinear resize of it (rounded to uint8, so within half a level per pixel)."""
    big = np.asarray(condition_image(3, width=96, height=72))
    result = np.asarray(condition_image(4, width=48, height=36))
    resized = np.asarray(Image.fromarray(big).resize((48, 36), Image.Resampling.BILINEAR))
    out = _score(_chw(result).unsqueeze(0), [(_chw(big),)], threshold=32)
    assert out.scores_B.item() == pytest.approx(_numpy_preservation(result, resized, 32), abs=0.01)
    # the resized source itself scores ~1 against the big one
    assert _score(_chw(resized).unsqueeze(0), [(_chw(big),)]).scores_B.item() > 0.97


def test_identical_is_one_unrelated_is_low_and_a_local_edit_is_high():
    generator = np.random.default_rng(7)
    red = render(parse_prompt("a red circle"), 64, np.random.default_rng(3))
    blue = render(parse_prompt("a blue circle"), 64, np.random.default_rng(3))  # same layout, recoloured
    photo, other_photo = np.asarray(condition_image(1, 64, 64)), np.asarray(condition_image(2, 64, 64))
    noise = generator.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    pairs = [(red, red), (blue, red), (other_photo, photo), (noise, photo)]
    pixels = torch.stack([_chw(result) for result, _ in pairs])
    identical, local_edit, unrelated, unrelated_noise = _score(
        pixels, [(_chw(source),) for _, source in pairs]
    ).scores_B.tolist()
    assert identical == 1.0
    assert local_edit > 0.95  # the circle changed colour, the rest of the picture is kept
    # two smooth pictures: 1 - mean |difference| would still call them 87% alike
    assert unrelated < 0.3 and unrelated_noise < 0.05


def test_the_source_index_picks_the_condition_image_and_videos_average_frames():
    source, other = _chw(np.asarray(condition_image(1, 32, 32))), _chw(np.asarray(condition_image(2, 32, 32)))
    video = torch.stack([source, other]).unsqueeze(0)  # one video: the source, then an unrelated frame
    first = _score(video, [(source, other)]).scores_B.item()
    frames = _score(torch.stack([source, other]), [(source, other)] * 2).scores_B
    assert first == pytest.approx(frames.mean().item())
    second = _score(source.unsqueeze(0), [(source, other)], source_index=1).scores_B.item()
    assert second == pytest.approx(frames[1].item())  # other vs source, from the other side


def test_clear_errors():
    pixels = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"this batch has none.*image-edit model.*reward.functions.edit_preservation"
    ):
        _score(pixels, None)
    with pytest.raises(
        ValueError, match=r"sample 0 has 1 condition image.*source_index=1.*args.source_index"
    ):
        _score(pixels, [(torch.zeros(3, 8, 8, dtype=torch.uint8),)], source_index=1)
    for bad in (0, -1, 300, "32", True):
        with pytest.raises(ValueError, match=r"threshold=.* is invalid: must be a number in \(0, 255\]"):
            build_reward("edit_preservation", {"threshold": bad})
    with pytest.raises(ValueError, match=r"unknown argument 'sources'"):
        build_reward("edit_preservation", {"sources": []})  # never a config arg


def _text(text: str, background: np.ndarray) -> np.ndarray:
    image = Image.fromarray(background.copy())
    ImageDraw.Draw(image).text((12, 20), text, fill="black", font=ImageFont.truetype(str(FONT), 36))
    return np.asarray(image)


def test_an_edit_runs_rewards_combine_with_the_instruction_as_the_prompt():
    """`reward.functions` of an edit run: edit_preservation (reads the sources) with the shapes
    verifier and OCR (read the instruction and the row's target, ignore the sources): each scores
    as it does alone, and the total is the weighted sum."""
    red = render(parse_prompt("a red circle"), 64, np.random.default_rng(3))
    blue = render(parse_prompt("a blue circle"), 64, np.random.default_rng(3))
    green = render(parse_prompt("a green circle"), 64, np.random.default_rng(3))
    sign = np.full((96, 320, 3), 235, np.uint8)
    instructions = ["make the circle blue", "make the circle blue", 'write "OPEN" on the sign']
    target = {"scene": parse_prompt("a blue circle").to_dict()}
    metadata = [target, target, {"scene": parse_prompt("a red circle").to_dict()}]
    # OCR's target is the quoted text of the instruction; the shapes verifier's the row's scene
    functions = {
        "edit_preservation": {"weight": 1.0},
        "shapes": {"weight": 0.5},
        "ocr": {"weight": 0.25, "args": {"target_from_prompt": True, "target_key": "ocr_text"}},
    }
    # two micro-batches of one run: the shapes edits, then the sign (OCR reads it, shapes do not care)
    shapes_batch = torch.stack([_chw(blue), _chw(green)])
    shapes_sources = [(_chw(red),)] * 2
    rewards = MultiReward({k: v for k, v in functions.items() if k != "ocr"})
    out = rewards(shapes_batch, instructions[:2], metadata[:2], shapes_sources)
    alone = {
        "edit_preservation": _score(shapes_batch, shapes_sources).scores_B,
        "shapes": build_reward("shapes")(shapes_batch, instructions[:2], metadata[:2]).scores_B,
    }
    for name, scores in alone.items():
        torch.testing.assert_close(out.scores[name], scores)
    assert out.scores["shapes"][0] == 1.0 > out.scores["shapes"][1]  # blue follows the instruction, green not
    torch.testing.assert_close(out.total_B, alone["edit_preservation"] + 0.5 * alone["shapes"])

    if not FONT.is_file():
        pytest.fail(f"{FONT} is missing: apt-get install fonts-dejavu-core")
    ocr_rewards = MultiReward({k: v for k, v in functions.items() if k != "shapes"})
    written = torch.stack([_chw(_text("OPEN", sign)), _chw(_text("SHUT", sign))])
    out = ocr_rewards(written, [instructions[2]] * 2, [{}, {}], [(_chw(sign),)] * 2)
    assert out.scores["ocr"][0].item() == 1.0 and out.scores["ocr"][1].item() < 0.5
    preserved = _score(written, [(_chw(sign),)] * 2).scores_B
    torch.testing.assert_close(out.total_B, preserved + 0.25 * out.scores["ocr"])
    assert (preserved > 0.8).all()  # the text is a small part of the sign
