"""RL algorithm math (advantages, losses, KL, rollout mismatch, reward shaping, on-policy distillation), free of any
distributed or model code; the policy losses and advantage estimators are registered by name (`registry.py`), so that
a user can add their own.

Per-token tensors are [B, S] with a 0/1 response_mask; per-sequence tensors are [B].
"""
from rl_megatron.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    needs_critic,
    outcome_token_rewards,
    register_adv_estimator,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rl_megatron.algorithms.distillation import distillation_advantages, reverse_kl, top_k_kl
from rl_megatron.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_controller,
    kl_divergence,
)
from rl_megatron.algorithms.losses import (LOSS_AGG_MODES, LossScale, LossStats, aggregate_loss,
                                          megatron_loss_factor, policy_loss, value_loss)
from rl_megatron.algorithms.masked import masked_mean, masked_sum, masked_whiten
from rl_megatron.algorithms.mismatch import (rollout_correction_metrics, rollout_correction_weights,
                                            rollout_mismatch_metrics)
from rl_megatron.algorithms.policy_losses import (POLICY_LOSSES, cispo_loss, clip_cov_loss, gspo_loss, kl_cov_loss,
                                                  ppo_loss, register_policy_loss)
from rl_megatron.algorithms.reward_shaping import overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "LossScale",
    "LossStats",
    "aggregate_loss",
    "apply_kl_penalty",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages",
    "distillation_advantages",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_controller",
    "kl_cov_loss",
    "kl_divergence",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "megatron_loss_factor",
    "needs_critic",
    "outcome_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "ppo_loss",
    "register_adv_estimator",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reverse_kl",
    "rloo_advantages",
    "rollout_correction_metrics",
    "rollout_correction_weights",
    "rollout_mismatch_metrics",
    "top_k_kl",
    "value_loss",
]
