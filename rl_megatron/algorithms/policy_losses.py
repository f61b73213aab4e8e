"""Policy losses by name (`actor.policy_loss`): PPO's clipped surrogate (the default) and the 2025 variants.

Every loss has one signature, so that the actor calls any of them (a user's own too) the same way:

    loss(log_probs, old_log_probs, advantages, response_mask, *, actor, scale, importance_weights=None)
        -> (this micro-batch's share of the mini-batch loss, LossStats)

log_probs are the policy's [B, S] (with gradient), old_log_probs the same tokens' before the update, advantages [B, S]
(or [B]), `actor` the actor config section (clip ranges, actor.loss_agg_mode, each loss's own keys), `scale` the
mini-batch's sizes (`LossScale`: aggregate with `aggregate_loss(per_token, mask, actor.loss_agg_mode, scale)`), and
importance_weights the rollout correction's per-token weights (algorithm.rollout_correction), which multiply the
per-token loss. Token sums in the stats are reported as actor/<name> averaged over response tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from rl_megatron.algorithms.losses import LossScale, LossStats, policy_loss
from rl_megatron.algorithms.registry import Registry

if TYPE_CHECKING:  # for the annotations only: the config schema imports this package
    from rl_megatron.config.schema import ActorConfig

PolicyLoss = Callable[..., tuple[Tensor, LossStats]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor.policy_loss",
                                               "rl_megatron.algorithms.register_policy_loss")


def register_policy_loss(name: str):
    """Register a policy loss with the signature of this module's docstring under `name`."""
    return POLICY_LOSSES.register(name)


@register_policy_loss("ppo")
def ppo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
             actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """PPO (Schulman et al., 2017), per token: max(-A r, -A clip(r, 1 - low, 1 + high)) with r = exp(logp - old),
    capped at -A c for A < 0 with dual-clip (Ye et al., 2020; actor.clip_ratio_c). See `losses.policy_loss`."""
    return policy_loss(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=actor.clip_ratio_low,
                       clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                       agg_mode=actor.loss_agg_mode, scale=scale, importance_weights=importance_weights)
