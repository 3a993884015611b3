"""The allowed values of the keys whose meaning is implemented above the config.

The config checks a value against these; the code that implements the choice (the SDE step, the
KL term, DiffusionNFT's advantage mapping, rollout correction) imports them from here, so the list
is written once and the config imports none of that code (DESIGN.md, "Layers"). Stdlib only.
"""

#: `rollout.sde.type` (all but "ode") and `diffrl.sde.step`'s kinds.
SDE_KINDS = ("sde", "cps", "dance_sde", "ode")
#: `actor.loss.kl_std`: what divides the squared mean gap of the KL term (`diffrl.algos.kl`).
KL_STD_CHOICES = ("sde", "transition")
#: `algorithm.adv_mode`: how DiffusionNFT turns advantages into optimality probabilities
#: (`diffrl.algos.nft`).
NFT_ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")
#: `algorithm.rollout_correction.*` (`diffrl.algos.rollout_correction`): importance-weight levels and
#: modes, rejection statistics and their levels.
IS_LEVELS = ("none", "step", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
REJECTIONS = ("none", "k1", "k2", "k3")
REJECTION_LEVELS = ("step", "sequence_mean", "sequence_sum", "sequence_max")
