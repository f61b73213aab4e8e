"""RL algorithm math (advantages, losses, KL, rollout mismatch), free of any distributed or model code.

Per-token tensors are [B, S] with a 0/1 response_mask; per-sequence tensors are [B].
"""
from rl_megatron.algorithms.advantages import (
    ESTIMATORS,
    NEEDS_CRITIC,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rl_megatron.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_controller,
    kl_divergence,
)
from rl_megatron.algorithms.losses import (LOSS_AGG_MODES, LossScale, LossStats, aggregate_loss, policy_loss,
                                          value_loss)
from rl_megatron.algorithms.masked import masked_mean, masked_sum, masked_whiten
from rl_megatron.algorithms.mismatch import rollout_correction_weights, rollout_mismatch_metrics

__all__ = [
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "NEEDS_CRITIC",
    "AdaptiveKLController",
    "FixedKLController",
    "LossScale",
    "LossStats",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
    "kl_controller",
    "kl_divergence",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "outcome_token_rewards",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
    "rollout_mismatch_metrics",
    "value_loss",
]
