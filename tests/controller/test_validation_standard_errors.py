"""The standard errors a validation logs (`val/rewards/mean_se`, `val/accuracy_se`), which the
run-health watchdog judges falls by, against numpy's on the same samples."""

import math

import numpy as np
import torch

from diffrl.controller.validation import standard_errors


def test_the_standard_errors_are_numpys_per_sample_and_over_the_category_means():
    rng = np.random.default_rng(0)
    sources = ["colors"] * 5 + ["counting"] * 3 + ["position"] * 4
    rewards = rng.normal(size=len(sources))
    verdicts = np.array([1, 0, 1, 1, 0, 1, 1, 0, 0, 1, np.nan, 0], dtype=float)  # a NaN: no verdict
    got = standard_errors(torch.tensor(rewards, dtype=torch.float32), sources, torch.tensor(verdicts))

    rewards32 = rewards.astype(np.float32).astype(np.float64)
    assert math.isclose(got["val/rewards/mean_se"], rewards32.std(ddof=1) / math.sqrt(len(sources)))
    per_source = []
    for source in ("colors", "counting", "position"):
        v = verdicts[[s == source for s in sources]]
        v = v[~np.isnan(v)]
        per_source.append(v.var(ddof=1) / len(v))
    # the error of the mean of the three category means (val/accuracy)
    assert math.isclose(got["val/accuracy_se"], math.sqrt(sum(per_source)) / 3)


def test_a_category_with_one_verdict_leaves_the_accuracy_error_out_and_one_sample_both():
    sources = ["colors", "colors", "counting"]
    got = standard_errors(torch.tensor([0.1, 0.5, 0.9]), sources, torch.tensor([1.0, 0.0, 1.0]))
    assert set(got) == {"val/rewards/mean_se"}  # counting has one verdict: no variance to estimate
    assert standard_errors(torch.tensor([0.3]), ["colors"], torch.tensor([1.0])) == {}
    assert set(standard_errors(torch.tensor([0.1, 0.2]), sources[:2], None)) == {"val/rewards/mean_se"}
