"""The algorithms, each declared in its own file, and the advantage estimators.

Importing this package registers every built-in algorithm (`diffrl.algos.spec` says what a
declaration holds), in the order their settings appear under `actor.loss`:
policy gradient (a loss per SDE window step, `LossInputs` + `StepOut`): "flow_grpo", "grpo_guard",
"flow_dppo";
direct preference (forward process, its own inputs + the network's velocity): "diffusion_nft",
"awm", "dpo";
distillation (a few-step student against the base as teacher, `DMDInputs`): "dmd2".
The KL penalty (`KLLoss`) adds to any policy-gradient loss; advantage estimators: "flow_grpo".
Rollout correction (`diffrl.algos.rollout_correction`) is plain functions, not registered.

Nothing here imports torch at import time (`diffrl.lazy`): the config schema reads these
declarations.
"""

from diffrl.algos import advantages, flow_grpo, grpo_guard, flow_dppo, nft, dpo, awm, dmd2, kl  # noqa: F401, I001  (registration on import, in this order)
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
    Registry,
    get_advantage_estimator,
    register_advantage,
)
from diffrl.algos.spec import (
    ALGORITHMS,
    DIRECT_PREFERENCE,
    DISTILLATION,
    LOOPS,
    PAIRS,
    POLICY_GRADIENT,
    SAMPLES,
    AlgorithmSpec,
    DirectPreferenceSpec,
    DistillationSpec,
    PolicyGradientSpec,
    Velocities,
    algorithm,
    algorithm_settings,
    algorithms,
    register_algorithm,
    uses_old_adapter,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "DIRECT_PREFERENCE",
    "DISTILLATION",
    "LOOPS",
    "PAIRS",
    "POLICY_GRADIENT",
    "SAMPLES",
    "AWMInputs",
    "AWMLoss",
    "AlgorithmSpec",
    "DPOInputs",
    "DPOLoss",
    "DiffusionNFTLoss",
    "DirectPreferenceSpec",
    "DistillationSpec",
    "FlowDPPOLoss",
    "FlowGRPOLoss",
    "GRPOGuardLoss",
    "KLLoss",
    "Loss",
    "LossInputs",
    "NFTInputs",
    "PolicyGradientSpec",
    "Registry",
    "Velocities",
    "advantage_metrics",
    "algorithm",
    "algorithm_settings",
    "algorithms",
    "compute_flow_grpo_advantages",
    "get_advantage_estimator",
    "old_policy_decay",
    "preference_pairs",
    "register_advantage",
    "register_algorithm",
    "reward_metrics",
    "uses_old_adapter",
]
