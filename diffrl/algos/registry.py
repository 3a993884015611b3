"""The advantage-estimator registry (the `Registry` class itself lives in `diffrl.registry`).

A config names an object by a stable string (`algorithm.adv_estimator`; `actor.loss.mode` names an
algorithm declaration, `diffrl.algos.spec`); the trainer looks it up here. Registration is
explicit, at import time of the module that defines the object:

    @register_advantage("flow_grpo")
    def compute_flow_grpo_advantages(rewards_B, uids, cfg): ...

`diffrl.algos` imports every built-in algorithm module, so `import diffrl.algos` fills the
registries. A user's own algorithm registers the same way from their module, imported before the
trainer starts. Unknown names raise `ValueError` listing what is registered (with a did-you-mean);
registering a taken name raises instead of silently replacing the first one.
"""

from __future__ import annotations

# The table is the config's (it checks algorithm.adv_estimator): diffrl.config.registries.
from diffrl.config.registries import ADVANTAGE_ESTIMATORS, get_advantage_estimator, register_advantage
from diffrl.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "Registry", "get_advantage_estimator", "register_advantage"]
