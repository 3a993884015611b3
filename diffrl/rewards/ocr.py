"""OCR reward: does the image show the requested text? Tesseract reads it, edit distance scores it.

    score = 1 - min(d, len(target)) / len(target),   d = Levenshtein(normalise(read), normalise(target))

so 1 is an exact read, 0 is nothing right (or more wrong characters than the target has).
`normalise` lower-cases and deletes all whitespace, so case and spacing do not count (Tesseract
often merges or splits words; the text-rendering task is about the characters). This is Flow-GRPO's
OCR reward with Tesseract in place of PaddleOCR: Tesseract is a Debian package (`tesseract-ocr`)
used through `pytesseract`, needs no GPU and no download.

The target text of each sample comes from its metadata, key `ocr_text` by default (`target_key`
changes it), e.g. a JSONL prompt row `{"prompt": "a sign that says \\"Open\\"", "ocr_text": "Open"}`.
With `target_from_prompt=true`, a sample without that key uses the first double-quoted span of its
prompt instead (Flow-GRPO's prompt convention).

Extras: `edit_distance` (d, per sample; for videos the mean over frames).
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import ImageReward, RewardOutput, to_pil
from diffrl.rewards.registry import register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy

INSTALL_HINT = (
    "install Tesseract: `apt-get install tesseract-ocr` (Debian/Ubuntu), `brew install tesseract` "
    "(macOS), or pass args.tesseract_cmd=/path/to/tesseract"
)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions
    turning `a` into `b`. O(len(a)·len(b)) time, O(min) memory; targets are short phrases."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(
                min(
                    previous[j] + 1,  # delete char_a
                    current[j - 1] + 1,  # insert char_b
                    previous[j - 1] + (char_a != char_b),  # substitute (free when equal)
                )
            )
        previous = current
    return previous[-1]


def normalise_text(text: str) -> str:
    """Lower-case and drop all whitespace: 'Hello  World\\n' -> 'helloworld'."""
    return "".join(text.lower().split())


def ocr_score(read: str, target: str) -> tuple[float, int]:
    """(score, edit distance) of recognised text `read` against `target`, both normalised here."""
    want = normalise_text(target)
    if not want:
        raise ValueError(f"OCR target {target!r} is empty after normalisation (case and spaces removed)")
    distance = edit_distance(normalise_text(read), want)
    return 1.0 - min(distance, len(want)) / len(want), distance


_QUOTED = re.compile(r'"([^"]+)"')


@register_reward("ocr")
class OcrReward(ImageReward):
    """Tesseract OCR vs the sample's target text (see the module docstring for the formula).

    Args:
        target_key: metadata key holding each sample's target text.
        target_from_prompt: fall back to the prompt's first "double-quoted" span when the key is absent.
        lang: Tesseract language(s), e.g. "eng" or "eng+deu" (Debian: tesseract-ocr-<lang>).
        psm: Tesseract page segmentation mode; 6 = one uniform block of text, 11 = sparse text.
        tesseract_cmd: path of the tesseract binary when it is not on PATH.
        threads: images read in parallel (each is a tesseract subprocess); default: CPU count.
    """

    name = "ocr"

    def __init__(
        self,
        target_key: str = "ocr_text",
        target_from_prompt: bool = False,
        lang: str = "eng",
        psm: int = 6,
        tesseract_cmd: str | None = None,
        threads: int | None = None,
    ) -> None:
        import pytesseract

        self._pytesseract = pytesseract
        if tesseract_cmd is not None:
            if shutil.which(tesseract_cmd) is None:
                raise FileNotFoundError(
                    f"ocr reward: args.tesseract_cmd={tesseract_cmd!r} is not an executable; {INSTALL_HINT}"
                )
            # pytesseract's documented way to point at a binary off PATH (a process-wide setting).
            pytesseract.pytesseract.tesseract_cmd = tesseract_cmd
        try:
            self.version = str(pytesseract.get_tesseract_version())
        except pytesseract.TesseractNotFoundError as err:
            cmd = pytesseract.pytesseract.tesseract_cmd
            raise FileNotFoundError(
                f"ocr reward: the Tesseract binary {cmd!r} was not found; {INSTALL_HINT}"
            ) from err
        installed = set(pytesseract.get_languages(config=""))
        missing = [code for code in lang.split("+") if code not in installed]
        if missing:
            raise ValueError(
                f"ocr reward: lang={lang!r} needs Tesseract language data {missing} that is not installed "
                f"(installed: {', '.join(sorted(installed))}); on Debian: apt-get install "
                + " ".join(f"tesseract-ocr-{code}" for code in missing)
            )
        if not 0 <= psm <= 13:
            raise ValueError(
                f"ocr reward: psm={psm!r} is invalid: Tesseract page segmentation modes are 0..13"
            )
        if threads is not None and threads < 1:
            raise ValueError(
                f"ocr reward: threads={threads!r} is invalid: must be >= 1, or null for the CPU count"
            )
        self.target_key = target_key
        self.target_from_prompt = target_from_prompt
        self.lang = lang
        self.config = f"--psm {psm}"
        self.threads = threads or os.cpu_count() or 1

    def target(self, prompt: str, row: dict[str, Any], index: int) -> str:
        """The text sample `index` should show."""
        if self.target_key in row:
            return str(row[self.target_key])
        if self.target_from_prompt:
            match = _QUOTED.search(prompt)
            if match:
                return match.group(1)
            raise ValueError(
                f"ocr reward: sample {index} has no metadata[{self.target_key!r}] and its prompt {prompt!r} "
                'has no "double-quoted" text to read'
            )
        raise ValueError(
            f"ocr reward: sample {index} has no metadata[{self.target_key!r}] (its keys: {sorted(row)}). "
            f"Add the target text under {self.target_key!r} in the prompt dataset, set args.target_key to "
            'the key that holds it, or set args.target_from_prompt=true to read the "quoted" part of the prompt'
        )

    def read(self, frames_N3HW: torch.Tensor) -> list[str]:
        """The text Tesseract reads in each frame."""
        images = to_pil(frames_N3HW)

        def _one(image: Any) -> str:
            return self._pytesseract.image_to_string(image, lang=self.lang, config=self.config)

        with ThreadPoolExecutor(max_workers=min(self.threads, len(images))) as pool:
            return list(pool.map(_one, images))

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        targets = [
            self.target(p, row, i) for i, (p, row) in enumerate(zip(prompts_N, metadata_N, strict=True))
        ]
        results = [ocr_score(read, want) for read, want in zip(self.read(frames_N3HW), targets, strict=True)]
        return RewardOutput(
            torch.tensor([score for score, _ in results], dtype=torch.float32),
            {"edit_distance": torch.tensor([d for _, d in results], dtype=torch.float32)},
        )
