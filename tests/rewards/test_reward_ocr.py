"""OCR reward: edit distance, normalisation, and Tesseract reading text rendered by Pillow.

Tesseract is a hard requirement of these tests (CI installs it): when it is missing they FAIL
with the install command, they do not skip.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from diffrl.rewards import build_reward
from diffrl.rewards.ocr import edit_distance, normalise_text, ocr_score

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")  # Debian: fonts-dejavu-core


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("intention", "execution", 5),
        ("abc", "abc", 0),
        ("abc", "acb", 2),  # no transpositions in Levenshtein
        ("gumbo", "gambol", 2),
    ],
)
def test_edit_distance_hand_cases(a, b, expected):
    assert edit_distance(a, b) == expected
    assert edit_distance(b, a) == expected


def test_normalisation_ignores_case_and_spaces():
    assert normalise_text(" Hello \n WORLD\t") == "helloworld"
    assert ocr_score("HELLO world\n", "hello world") == (1.0, 0)
    assert ocr_score("hallo world", "Hello World") == (1 - 1 / 10, 1)
    # More wrong characters than the target has: clipped at 0, never negative.
    assert ocr_score("xyz 12345", "abc") == (0.0, 8)  # 5 deletions + 3 substitutions
    with pytest.raises(ValueError, match=r"empty after normalisation"):
        ocr_score("x", "  ")


def _require_tesseract():
    if shutil.which("tesseract") is None:
        pytest.fail(
            "the tesseract binary is not installed: apt-get install tesseract-ocr (Debian/Ubuntu) "
            "or brew install tesseract (macOS); CI installs it"
        )
    if not FONT.is_file():
        pytest.fail(f"{FONT} is missing: apt-get install fonts-dejavu-core")


def _render(text: str) -> torch.Tensor:
    image = Image.new("RGB", (384, 96), "white")
    ImageDraw.Draw(image).text((16, 24), text, fill="black", font=ImageFont.truetype(str(FONT), 36))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def test_ocr_reads_the_right_text_and_rejects_wrong_text():
    _require_tesseract()
    reward = build_reward("ocr")
    pixels = torch.stack([_render("Hello World"), _render("diffrl rocks"), _render("Hello World")])
    metadata = [{"ocr_text": "hello world"}, {"ocr_text": "Quantum"}, {"ocr_text": "Goodbye Moon"}]
    out = reward(pixels, ["a sign", "a sign", "a sign"], metadata)
    right, wrong_a, wrong_b = out.scores_B.tolist()
    assert right == 1.0
    assert wrong_a < 0.3 and wrong_b < 0.5
    assert out.extras["edit_distance"][0].item() == 0


def test_ocr_target_from_prompt_and_missing_target_errors():
    _require_tesseract()
    pixels = _render("Open").unsqueeze(0)
    out = build_reward("ocr", {"target_from_prompt": True})(pixels, ['a door sign that says "OPEN"'], [{}])
    assert out.scores_B.item() == 1.0
    with pytest.raises(ValueError, match=r"sample 0 has no metadata\['ocr_text'\].*args.target_key"):
        build_reward("ocr")(pixels, ["a sign"], [{"text": "Open"}])
    assert (
        build_reward("ocr", {"target_key": "text"})(pixels, ["a sign"], [{"text": "open"}]).scores_B.item()
        == 1.0
    )


def test_blank_image_scores_zero():
    _require_tesseract()
    blank = torch.full((1, 3, 96, 384), 255, dtype=torch.uint8)
    assert build_reward("ocr")(blank, ["p"], [{"ocr_text": "Hello"}]).scores_B.item() == 0.0


def test_missing_tesseract_is_a_clear_error(monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"apt-get install tesseract-ocr"):
        build_reward("ocr", {"tesseract_cmd": "/nonexistent/tesseract"})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(
        FileNotFoundError, match=r"Tesseract binary 'tesseract' was not found.*apt-get install tesseract-ocr"
    ):
        build_reward("ocr")


def test_missing_language_data_names_the_package():
    _require_tesseract()
    with pytest.raises(ValueError, match=r"lang='eng\+xyz'.*apt-get install tesseract-ocr-xyz"):
        build_reward("ocr", {"lang": "eng+xyz"})
