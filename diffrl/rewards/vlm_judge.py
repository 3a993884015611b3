"""`vlm_judge`: a vision-language model asked a yes/no question about each image (VQAScore).

The judge is a Qwen2.5-VL or Qwen3-VL checkpoint in a local directory (transformers'
`Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration`, picked by config.json's
`model_type`). For each sample it sees the image and a question, rendered by the checkpoint's own
chat template as one user turn followed by the assistant's turn, and the score is the
probability that the answer starts with "Yes" rather than "No" (Lin et al., VQAScore, 2024):

    z_yes, z_no = the next-token logits of `yes_token` and `no_token` after the prompt
    score       = exp(z_yes) / (exp(z_yes) + exp(z_no)) = sigmoid(z_yes − z_no)      ∈ (0, 1)

The question:

- by default `template` with `{prompt}` replaced by the sample's prompt
  ('Does this image show "{prompt}"? Please answer yes or no.');
- several questions (GenEval/DSG-style decompositions): when the sample's metadata holds
  `questions_key` (default `questions`, a list of strings, e.g. a JSONL row
  `{"prompt": "...", "questions": ["Is there a cat?", "Is the cat black?"]}`), each question is
  asked through `question_template` (`{question}` replaced, `{prompt}` too if present) and the
  score is the mean of their P(Yes); extra `min_p_yes` is the smallest (all must hold);
- edit runs (image-edit models): when the sample has source images (`sources`, `edit: auto`),
  the judge sees two images, the source (`source_index`) then the result, and `edit_template`
  asks whether the result follows the instruction (the prompt). Questions work the same way, with
  both images. `edit: false` ignores sources; `edit: true` makes a sample without one an error.

Batched `batch_size` questions per forward, left-padded (the last position of every row is its
own last token); on the GPU when one is visible, bfloat16 there and float32 on the CPU. The two
logits are the model's last hidden state through the two rows of its LM head, in float32 (the
full-vocabulary logits are never formed). Videos are judged frame by frame and averaged
(`video_frames` picks fewer). Extras: `questions` (questions asked per sample), `min_p_yes`.

This module declares the reward and checks its settings without torch; loading and running the
model is `diffrl.rewards.vlm_judge_model`, which the constructor imports.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import RewardOutput, check_batch, flatten_frames, mean_over_frames, to_pil
from diffrl.rewards.registry import register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy

PROMPT = "{prompt}"
QUESTION = "{question}"
DEFAULT_TEMPLATE = 'Does this image show "{prompt}"? Please answer yes or no.'
DEFAULT_QUESTION_TEMPLATE = "{question} Please answer yes or no."
DEFAULT_EDIT_TEMPLATE = (
    "The first image is the original and the second image is the result of editing it with the "
    'instruction "{prompt}". Does the second image follow the instruction? Please answer yes or no.'
)
EDIT_MODES = ("auto", True, False)


@dataclass(frozen=True)
class JudgeSettings:
    """The checked settings of one `vlm_judge` (the constructor's arguments but the model's)."""

    template: str
    question_template: str
    edit_template: str
    questions_key: str | None
    edit: str | bool
    source_index: int
    yes_token: str
    no_token: str
    max_pixels: int | None
    device: str
    dtype: str
    batch_size: int


def _arg(name: str) -> str:
    return f"reward.functions.vlm_judge.args.{name}"


def _text(name: str, value: Any, placeholder: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"vlm_judge reward: {_arg(name)}={value!r} must be a non-empty string")
    if placeholder not in value:
        example = DEFAULT_QUESTION_TEMPLATE if placeholder == QUESTION else DEFAULT_TEMPLATE
        raise ValueError(
            f"vlm_judge reward: {_arg(name)}={value!r} has no {placeholder} placeholder; write {placeholder} "
            f"where the {placeholder.strip('{}')} goes, e.g. {_arg(name)}={example!r}"
        )
    return value


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"vlm_judge reward: {_arg(name)}={value!r} is invalid: must be an integer >= {minimum}"
        )
    return value


def check_settings(
    template: Any,
    question_template: Any,
    edit_template: Any,
    questions_key: Any,
    edit: Any,
    source_index: Any,
    yes_token: Any,
    no_token: Any,
    max_pixels: Any,
    device: Any,
    dtype: Any,
    batch_size: Any,
) -> JudgeSettings:
    """The settings as `JudgeSettings`, or a ValueError naming the bad one and the fix."""
    for name, token in (("yes_token", yes_token), ("no_token", no_token)):
        if not isinstance(token, str) or not token:
            raise ValueError(
                f"vlm_judge reward: {_arg(name)}={token!r} must be a non-empty string (one token of the "
                "judge's vocabulary, e.g. 'Yes' / 'No')"
            )
    if yes_token == no_token:
        raise ValueError(
            f"vlm_judge reward: {_arg('yes_token')} and {_arg('no_token')} are both {yes_token!r}; they must differ"
        )
    if questions_key is not None and (not isinstance(questions_key, str) or not questions_key):
        raise ValueError(
            f"vlm_judge reward: {_arg('questions_key')}={questions_key!r} must be a metadata key (a non-empty "
            "string) or null (always ask the template)"
        )
    if not any(edit is mode for mode in EDIT_MODES[1:]) and edit != "auto":
        raise ValueError(
            f"vlm_judge reward: {_arg('edit')}={edit!r} is invalid: 'auto' (judge the edit when a sample has a "
            "source image), true (every sample must have one) or false (ignore source images)"
        )
    if max_pixels is not None:
        _count("max_pixels", max_pixels, 1)
    for name, value in (("device", device), ("dtype", dtype)):
        if not isinstance(value, str):
            raise ValueError(f"vlm_judge reward: {_arg(name)}={value!r} must be a string")
    return JudgeSettings(
        template=_text("template", template, PROMPT),
        question_template=_text("question_template", question_template, QUESTION),
        edit_template=_text("edit_template", edit_template, PROMPT),
        questions_key=questions_key,
        edit=edit,
        source_index=_count("source_index", source_index, 0),
        yes_token=yes_token,
        no_token=no_token,
        max_pixels=max_pixels,
        device=device,
        dtype=dtype,
        batch_size=_count("batch_size", batch_size, 1),
    )


def sample_questions(
    settings: JudgeSettings, prompt: str, metadata: Mapping[str, Any], edit: bool, index: int
) -> list[str]:
    """The question texts asked about sample `index` (module docstring), in order."""
    key = settings.questions_key
    if key is None or key not in metadata:
        template = settings.edit_template if edit else settings.template
        return [template.replace(PROMPT, prompt)]
    questions = metadata[key]
    if isinstance(questions, str):
        questions = [questions]
    if (
        not isinstance(questions, Sequence)
        or not questions
        or not all(isinstance(q, str) and q.strip() for q in questions)
    ):
        raise ValueError(
            f"vlm_judge reward: sample {index}'s metadata[{key!r}]={questions!r:.200} must be a non-empty list "
            f"of non-empty question strings (or drop the key to ask {_arg('template')})"
        )
    return [
        settings.question_template.replace(QUESTION, question).replace(PROMPT, prompt)
        for question in questions
    ]


@register_reward("vlm_judge")
class VlmJudge:
    """P("Yes") of a Qwen2.5-VL / Qwen3-VL judge asked about each image (module docstring).

    Args:
        model: local directory of the judge (config.json, weights, tokenizer, preprocessor_config.json,
            chat template), e.g. a snapshot of Qwen/Qwen2.5-VL-7B-Instruct.
        template: the question about the prompt; must contain {prompt}.
        question_template: how each of a sample's own questions is asked; must contain {question}.
        edit_template: the question about an edit (source, then result); must contain {prompt}.
        questions_key: metadata key of a sample's questions; null: always ask `template`.
        edit: "auto" (the edit question when a sample has a source image), true, false.
        source_index: which of the sample's condition images is the source.
        yes_token, no_token: the two answers compared; each must be one token of the judge's tokenizer.
        max_pixels: resize each image to at most this many pixels (null: the processor's own bound).
        device: "auto" (GPU if visible), "cpu", "cuda", "cuda:N".
        dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16", "float16".
        batch_size: questions per forward pass.
    """

    name = "vlm_judge"

    def __init__(
        self,
        model: str,
        template: str = DEFAULT_TEMPLATE,
        question_template: str = DEFAULT_QUESTION_TEMPLATE,
        edit_template: str = DEFAULT_EDIT_TEMPLATE,
        questions_key: str | None = "questions",
        edit: str | bool = "auto",
        source_index: int = 0,
        yes_token: str = "Yes",
        no_token: str = "No",
        max_pixels: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 8,
    ) -> None:
        args = dict(locals())
        del args["self"], args["model"]
        self.settings = self.check_args(**args)
        # call_reward hands source images only to a reward that reads them (base.takes_sources)
        self.takes_sources = self.settings.edit is not False
        from diffrl.rewards.vlm_judge_model import VlmScorer

        self.scorer = VlmScorer(model, self.settings)

    @staticmethod
    def check_args(**args: Any) -> JudgeSettings:
        """Check every setting but the model directory (read when the model loads); no torch."""
        params = inspect.signature(VlmJudge.__init__).parameters
        bound = {
            name: args.get(name, param.default)
            for name, param in params.items()
            if name not in ("self", "model")
        }
        return check_settings(**bound)

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        *,
        sources: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> RewardOutput:
        rows = check_batch(pixels, prompts, metadata)
        frames_N3HW, frames = flatten_frames(pixels)
        images = to_pil(frames_N3HW)
        queries: list[tuple[list[Any], str]] = []
        owner: list[int] = []  # the frame each query is about
        asked: list[int] = []
        for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            source = self._source(sources, i)
            questions = sample_questions(self.settings, prompt, row, source is not None, i)
            asked.append(len(questions))
            for f in range(i * frames, (i + 1) * frames):
                shown = [images[f]] if source is None else [source, images[f]]
                queries += [(shown, question) for question in questions]
                owner += [f] * len(questions)
        p_yes_Q = self.scorer.p_yes(queries)
        owner_Q = torch.tensor(owner)
        count_N = torch.bincount(owner_Q, minlength=frames_N3HW.shape[0]).to(torch.float32)
        mean_N = torch.zeros(frames_N3HW.shape[0]).index_add_(0, owner_Q, p_yes_Q) / count_N
        min_N = torch.full((frames_N3HW.shape[0],), float("inf")).scatter_reduce_(
            0, owner_Q, p_yes_Q, reduce="amin"
        )
        return RewardOutput(
            mean_over_frames(mean_N, frames),
            {
                "questions": torch.tensor(asked, dtype=torch.float32),
                "min_p_yes": mean_over_frames(min_N, frames),
            },
        )

    def _source(self, sources: Sequence[Sequence[torch.Tensor]] | None, index: int) -> Any:
        """Sample `index`'s source image as a PIL image, or None when it is not judged as an edit."""
        edit, at = self.settings.edit, self.settings.source_index
        row = None if sources is None or edit is False else sources[index]
        if row is None or len(row) == 0:
            if edit is True:
                raise ValueError(
                    f"vlm_judge reward: sample {index} has no source image, and {_arg('edit')}=true judges "
                    "edits only; use an image-edit model with condition images, or set edit=auto"
                )
            return None
        if at >= len(row):
            raise ValueError(
                f"vlm_judge reward: {_arg('source_index')}={at}, but sample {index} has {len(row)} source "
                f"image(s); use an index below {len(row)}"
            )
        return to_pil(row[at].unsqueeze(0))[0]
