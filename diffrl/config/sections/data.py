"""`data.*`: the prompt (and preference-pair) datasets and their columns."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.config.checks import require, require_at_least


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # .txt (one prompt per line), .jsonl, .parquet
    val_files: list[str] = field(default_factory=list)
    prompts_per_step: int = 8  # B: unique prompts per training step
    prompt_key: str = "prompt"  # the column holding the prompt in .jsonl/.parquet rows
    # image-edit models: the column with each row's condition image(s) (a path relative to the data
    # file, bytes in a parquet column, or a list of them); read only when the model takes them
    image_key: str = "image"
    # algorithm.sample_source=offline: the columns holding each row's preferred and dispreferred
    # image files (paths relative to the data file)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    shuffle: bool = True
    seed: int | None = None  # null = trainer.seed

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.prompts_per_step", self.prompts_per_step, 1)
        for key in ("prompt_key", "image_key", "chosen_key", "rejected_key"):
            value = getattr(self, key)
            require(bool(value), f"{at}.{key}", value, "must be a non-empty column name")
        require(
            self.chosen_key != self.rejected_key,
            f"{at}.rejected_key",
            self.rejected_key,
            f"must differ from {at}.chosen_key: the two images of a pair are in different columns",
        )
        require(
            self.image_key != self.prompt_key,
            f"{at}.image_key",
            self.image_key,
            f"must differ from {at}.prompt_key: the condition images and the prompt are different columns",
        )
        if self.seed is not None:
            require_at_least(f"{at}.seed", self.seed, 0)
