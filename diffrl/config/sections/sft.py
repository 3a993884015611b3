"""`sft.*`: supervised flow matching (`diffrl sft`)."""

from __future__ import annotations

from dataclasses import dataclass

from diffrl.config.checks import require, require_at_least, require_choice, require_positive


@dataclass
class SftConfig:
    """`diffrl sft`: supervised flow matching on (image, prompt) pairs; one image per data row per step."""

    # the column with each row's image file (relative to its data file), "shapes", or "shapes_edit"
    images: str = "image"
    weighting_scheme: str = "logit_normal"  # how training noise levels are drawn (diffusers' SD3 schemes)
    logit_mean: float = 0.0  # logit_normal: mean of the logit of the noise level
    logit_std: float = 1.0  # logit_normal: its std
    mode_scale: float = 1.29  # mode: the scale of the mode-sampling density
    prompt_dropout: float = 0.1  # probability of training a sample on the empty prompt (what CFG needs)
    data_workers: int = 0  # processes loading/rendering the next steps' images; 0 = in the training process

    # diffusers.training_utils.compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3.
    WEIGHTING_SCHEMES = ("logit_normal", "mode", "uniform", "sigma_sqrt", "cosmap")

    def validate(self, at: str) -> None:
        require(
            bool(self.images),
            f"{at}.images",
            self.images,
            "must name an image column, or be 'shapes' or 'shapes_edit'",
        )
        require_choice(f"{at}.weighting_scheme", self.weighting_scheme, self.WEIGHTING_SCHEMES)
        require_positive(f"{at}.logit_std", self.logit_std)
        require(
            0.0 <= self.prompt_dropout < 1.0, f"{at}.prompt_dropout", self.prompt_dropout, "must be in [0, 1)"
        )
        require_at_least(f"{at}.data_workers", self.data_workers, 0)
