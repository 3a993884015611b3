"""Advantage estimators and losses, looked up by name from the config.

Importing this package registers every built-in algorithm:
advantage estimators: "flow_grpo";
policy-gradient losses (per SDE window step, `LossInputs` + `StepOut`): "flow_grpo", "grpo_guard",
"flow_dppo", and the "kl" penalty;
direct-preference losses (forward process, own inputs + the network's velocity): "awm",
"diffusion_nft", "dpo".
Rollout correction (`diffrl.algos.rollout_correction`) is plain functions, not registered.
"""

from diffrl.algos import advantages, awm, dpo, flow_dppo, flow_grpo, grpo_guard, kl, nft  # noqa: F401  (registration on import)
from diffrl.algos.advantages import compute_flow_grpo_advantages
from diffrl.algos.awm import AWMInputs, AWMLoss
from diffrl.algos.base import Loss, LossInputs
from diffrl.algos.dpo import DPOInputs, DPOLoss, preference_pairs
from diffrl.algos.flow_dppo import FlowDPPOLoss
from diffrl.algos.flow_grpo import FlowGRPOLoss
from diffrl.algos.grpo_guard import GRPOGuardLoss
from diffrl.algos.kl import KLLoss
from diffrl.algos.metrics import advantage_metrics, reward_metrics
from diffrl.algos.nft import DiffusionNFTLoss, NFTInputs, old_policy_decay
from diffrl.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSSES,
    Registry,
    get_advantage_estimator,
    get_loss,
    register_advantage,
    register_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSSES",
    "AWMInputs",
    "AWMLoss",
    "DPOInputs",
    "DPOLoss",
    "DiffusionNFTLoss",
    "FlowDPPOLoss",
    "FlowGRPOLoss",
    "GRPOGuardLoss",
    "KLLoss",
    "Loss",
    "LossInputs",
    "NFTInputs",
    "Registry",
    "advantage_metrics",
    "compute_flow_grpo_advantages",
    "get_advantage_estimator",
    "get_loss",
    "old_policy_decay",
    "preference_pairs",
    "register_advantage",
    "register_loss",
    "reward_metrics",
]
