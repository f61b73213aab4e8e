"""Policy losses by name (`actor.policy_loss`): PPO's clipped surrogate (the default) and the 2025 variants.

Every loss has one signature, so that the actor calls any of them (a user's own too) the same way:

    loss(log_probs, old_log_probs, advantages, response_mask, *, actor, scale, importance_weights=None[, config])
        -> (this micro-batch's share of the mini-batch loss, LossStats)

log_probs are the policy's [B, S] (with gradient), old_log_probs the same tokens' before the update, advantages [B, S]
(or [B]), `actor` the actor config section (clip ranges, actor.loss_agg_mode), `scale` the mini-batch's sizes
(`LossScale`: aggregate with `aggregate_loss(per_token, mask, actor.loss_agg_mode, scale)`), and importance_weights
the rollout correction's per-token weights (algorithm.rollout_correction), which multiply the per-token loss. A loss
registered with a dataclass of its own keys (`register_policy_loss(name, config=...)`) gets them as `config`, read
from the section named after it (actor.clip_cov.ratio). Token sums in the stats are reported as actor/<name>
averaged over response tokens.

Positions outside response_mask may hold anything (inf, NaN): every loss reads log-probs only through
`masked_log_ratio` or a `torch.where` on the mask, so they reach neither the loss nor its gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_megatron.algorithms.losses import (LossScale, LossStats, clipped_surrogate, masked_log_ratio, policy_loss,
                                          token_advantages, token_stats, weighted_aggregate)
from rl_megatron.algorithms.masked import masked_sum
from rl_megatron.config.fields import NOT_NEGATIVE, checked, within
from rl_megatron.config.schema import ActorConfig
from rl_megatron.errors import ConfigError
from rl_megatron.registry import Registry

PolicyLoss = Callable[..., tuple[Tensor, LossStats]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss", "actor.policy_loss",
    "register yours with @rl_megatron.algorithms.register_policy_loss({name!r}) in a module listed in trainer.imports")


def register_policy_loss(name: str, config: type | None = None):
    """Register a policy loss with the signature of this module's docstring under `name`; `config`: the dataclass of
    its own keys (section actor.<name>), passed to it as the keyword `config`."""
    return POLICY_LOSSES.register(name, config=config)


@register_policy_loss("ppo")
def ppo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
             actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """PPO (Schulman et al., 2017), per token: max(-A r, -A clip(r, 1 - low, 1 + high)) with r = exp(logp - old),
    capped at -A c for A < 0 with dual-clip (Ye et al., 2020; actor.clip_ratio_c). See `losses.policy_loss`."""
    return policy_loss(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=actor.clip_ratio_low,
                       clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
                       agg_mode=actor.loss_agg_mode, scale=scale, importance_weights=importance_weights)


@register_policy_loss("gspo")
def gspo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
              actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None
              ) -> tuple[Tensor, LossStats]:
    """GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071), in its GSPO-token form.

    The importance ratio is the sequence's, the geometric mean of its token ratios, so a sequence is clipped whole:

        s_i    = exp(mean over i's response tokens of (logp_t - old_t))
        s_i,t  = sg[s_i] * exp(logp_t - sg[logp_t])          (value s_i, gradient s_i * grad logp_t)
        loss_t = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    With one advantage per sequence this is GSPO's sequence-level objective; with one response token, PPO's. No
    dual-clip (actor.clip_ratio_c is not used). The paper's objective averages each sequence's tokens, then the
    sequences: set actor.loss_agg_mode=seq-mean-token-mean (verl forces that mode for GSPO; here the key decides, as
    for every loss). A mean log-ratio moves far less than a token's, so the paper's clip range is tiny:
    actor.clip_ratio_low=3e-4 actor.clip_ratio_high=4e-4 (PPO's 0.2 would clip next to nothing).

    Token sums: pg_clipfrac (tokens whose term was clipped), ppo_kl, and seq_ratio: each token carries its
    sequence's s_i, so reported over the tokens it is the token-weighted mean of s_i (a mean over sequences would
    not add up over micro-batches and ranks as token sums do).
    """
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(log_probs, old_log_probs, mask)
    sequence_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    # log_ratio - sg[log_ratio] is 0 with the gradient of logp_t (old_t is a constant), and 0 outside the mask.
    token_ratio = torch.exp(sequence_log_ratio.detach() + log_ratio - log_ratio.detach())
    per_token, clipped, _ = clipped_surrogate(token_ratio, token_advantages(advantages, mask), actor.clip_ratio_low,
                                              actor.clip_ratio_high)
    stats = token_stats(mask, log_ratio, pg_clipfrac=clipped, seq_ratio=token_ratio)
    return weighted_aggregate(per_token, mask, actor.loss_agg_mode, scale, importance_weights), stats


@dataclass
class CISPOConfig:
    clip_high: float = checked(0.2, NOT_NEGATIVE, formerly="actor.cispo_clip_high")  # a token's importance weight (its stop-gradient coefficient) is capped at 1 + this (MiniMax-M1's eps_high; no lower cap)


@register_policy_loss("cispo", config=CISPOConfig)
def cispo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
               actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None, config: CISPOConfig
               ) -> tuple[Tensor, LossStats]:
    """CISPO (MiniMax, 2025, "MiniMax-M1", arXiv:2506.13585): clip the importance weight, not the update. The
    clipped weight is a stop-gradient coefficient of the REINFORCE term, so no token leaves the gradient (PPO's
    clipped tokens have none):

        loss_t = -sg[min(r_t, 1 + clip_high)] * A_t * logp_t,   r_t = exp(logp_t - old_t)

    whose gradient is -min(r_t, 1 + clip_high) A_t grad logp_t. Upper bound only: the paper's
    clip(r, 1 - eps_low, 1 + eps_high) sets eps_low so large that it never binds (it tunes eps_high alone), so no
    lower bound is applied (verl clips with actor.clip_ratio_low/high instead; its CISPO example sets
    clip_ratio_low=10 to the same effect). The paper aggregates by token-mean (actor.loss_agg_mode's default). The
    loss's value, -w A logp, is not comparable to PPO's; only its gradient matters.

    Token sums: pg_clipfrac (tokens whose weight was capped), ppo_kl.
    """
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(log_probs, old_log_probs, mask)
    ratio = torch.exp(log_ratio)
    capped = ratio > 1.0 + config.clip_high
    weight = ratio.clamp(max=1.0 + config.clip_high).detach()
    per_token = -weight * token_advantages(advantages, mask) * torch.where(mask, log_probs.float(), 0.0)
    stats = token_stats(mask, log_ratio, pg_clipfrac=capped)
    return weighted_aggregate(per_token, mask, actor.loss_agg_mode, scale, importance_weights), stats


# --- Clip-Cov and KL-Cov: a few tokens picked by the covariance of their log-prob and advantage ------------------

def _token_covariance(log_probs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """(logp_t - mean logp) * (A_t - mean A) per response token, the means over the response tokens given;
    -inf elsewhere, so that no pick lands there. Detached: it only picks tokens."""
    log_probs = torch.where(mask, log_probs.detach().float(), 0.0)
    token_count = mask.sum().clamp(min=1)
    centred_log_probs = log_probs - log_probs.sum() / token_count
    centred_advantages = advantages - masked_sum(advantages, mask) / token_count
    return torch.where(mask, centred_log_probs * centred_advantages, -torch.inf)


def _pick_count(fraction: float, mask: Tensor) -> Tensor:
    """max(1, floor(fraction x response tokens)) as in the paper and verl (0 without response tokens), as a device
    tensor: no host sync. The product in float64, as Python's int(fraction * count) takes it."""
    token_count = mask.sum()
    return torch.minimum(torch.floor(token_count.double() * fraction).long().clamp(min=1), token_count)


def _picked_first(keys: Tensor, count: Tensor) -> Tensor:
    """True at the `count` smallest `keys` (ties in position order), False elsewhere. A stable sort and a rank,
    rather than topk(count), so that `count` can stay on the device."""
    order = keys.flatten().argsort(stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return (rank < count).view_as(keys)


# splitmix64's constants as signed int64: torch's int64 arithmetic wraps as uint64's would.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX = (0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)


def _shift_right(values: Tensor, bits: int) -> Tensor:
    """A logical (unsigned) right shift of int64 values."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def _data_keys(values: Tensor, mask: Tensor) -> Tensor:
    """A uniform random int64 key per position, reproducible from `values` at the mask only (so it changes from
    micro-batch to micro-batch and step to step): splitmix64 of (the integer sum of their float32 bit patterns, exact
    in any order of addition) + position. Computed on the device from the data, so no seed crosses to the host."""
    seed = torch.where(mask, values.detach().float(), 0.0).view(torch.int32).long().sum()
    keys = seed + (torch.arange(1, mask.numel() + 1, device=mask.device) * _GOLDEN)
    keys = (keys ^ _shift_right(keys, 30)) * _MIX[0]
    keys = (keys ^ _shift_right(keys, 27)) * _MIX[1]
    return (keys ^ _shift_right(keys, 31)).view_as(mask)


@dataclass
class ClipCovConfig:
    ratio: float = checked(0.0002, within(0, 1, low_open=True), formerly="actor.clip_cov_ratio")  # fraction of a micro-batch's response tokens (at least one) drawn from the covariance band to leave the policy gradient
    lb: float = checked(1.0, formerly="actor.clip_cov_lb")  # lower end of the band of token covariances (centred log-prob x centred advantage) to draw from
    ub: float = checked(5.0, formerly="actor.clip_cov_ub")  # upper end of that band (at least lb)

    def check(self, section: str) -> None:
        if self.lb > self.ub:
            raise ConfigError(f"{section}.lb={self.lb} is above {section}.ub={self.ub}: the covariance band clip_cov "
                              "draws from would be empty. Swap them.")


@register_policy_loss("clip_cov", config=ClipCovConfig)
def clip_cov_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                  actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None, config: ClipCovConfig
                  ) -> tuple[Tensor, LossStats]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617): the tokens whose log-prob and advantage covary most drive the entropy down; a few of them
    leave the policy gradient. With the covariance of each response token

        cov_t = (logp_t - mean logp) * (A_t - mean A)        (means over the response tokens)

    max(1, floor(ratio x response tokens)) tokens are drawn at random from those with cov_t in [lb, ub] that still
    have a gradient (not already clipped by PPO); a drawn token's term is 0 (no value, no gradient: the paper's
    objective, and verl's), every other token's is PPO's (`ppo_loss`, with actor.clip_ratio_low/high/c).

    The draw is reproducible and stays on the device: each candidate gets a pseudo-random key hashed from the
    micro-batch's old log-probs and its position (`_data_keys`), and the candidates of the smallest keys are drawn,
    instead of verl's torch.randperm on the global generator (which needs the candidates' count on the host). The
    same micro-batch thus draws the same tokens in every run and on every tensor- and context-parallel rank that
    computes its loss (their gradients must agree), and the global RNG is neither read nor advanced. The means and
    the draw are over the tokens of the micro-batch the loss sees (as
    in verl), so they depend on micro-batching (actor.micro_batch_size, actor.max_tokens_per_micro_batch).

    Token sums: pg_clipfrac (the drawn tokens, as verl reports it), pg_clipfrac_ppo and pg_clipfrac_lower (clipped
    and dual-clipped by PPO, ppo's pg_clipfrac and pg_clipfrac_lower), ppo_kl.
    """
    config.check("actor.clip_cov")
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(log_probs, old_log_probs, mask)
    advantages = token_advantages(advantages, mask)
    per_token, clipped, dual_clipped = clipped_surrogate(torch.exp(log_ratio), advantages, actor.clip_ratio_low,
                                                         actor.clip_ratio_high, actor.clip_ratio_c)
    covariance = _token_covariance(log_probs, advantages, mask)
    candidates = mask & ~clipped & ~dual_clipped & (covariance >= config.lb) & (covariance <= config.ub)
    keys = torch.where(candidates, _data_keys(old_log_probs, mask), torch.iinfo(torch.int64).max)
    drawn = candidates & _picked_first(keys, _pick_count(config.ratio, mask))
    per_token = torch.where(drawn, 0.0, per_token)
    stats = token_stats(mask, log_ratio, pg_clipfrac=drawn, pg_clipfrac_ppo=clipped, pg_clipfrac_lower=dual_clipped)
    return weighted_aggregate(per_token, mask, actor.loss_agg_mode, scale, importance_weights), stats


@dataclass
class KLCovConfig:
    ratio: float = checked(0.0002, within(0, 1, low_open=True), formerly="actor.kl_cov_ratio")  # fraction of a micro-batch's response tokens (at least one), those of the largest covariance, that get the KL penalty
    kl_coef: float = checked(0.1, NOT_NEGATIVE, formerly="actor.ppo_kl_coef")  # weight of the penalty |logp - old_logp| on those tokens (verl's ppo_kl_coef)


@register_policy_loss("kl_cov", config=KLCovConfig)
def kl_cov_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                actor: ActorConfig, scale: LossScale, importance_weights: Tensor | None = None, config: KLCovConfig
                ) -> tuple[Tensor, LossStats]:
    """KL-Cov (Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617): the max(1, floor(ratio x response tokens)) response tokens of the largest covariance
    cov_t (as in `clip_cov_loss`) get a KL penalty; every token has the importance-weighted policy gradient:

        loss_t = -A_t r_t + [t picked] * kl_coef * |logp_t - old_t|,   r_t = exp(logp_t - old_t)

    |logp - old| is the paper's per-token estimate of KL(pi_old || pi). No PPO clip, as in the paper's objective and
    verl's: the penalty is the trust region of the tokens that drive the entropy down (actor.clip_ratio_low/high/c
    are not used). The pick is the top-k by covariance (ties in position order): deterministic, no randomness,
    and no host sync (a sort and a rank on the device). The means and the top-k are over
    the tokens of the micro-batch the loss sees (as in verl), so they depend on micro-batching
    (actor.micro_batch_size, actor.max_tokens_per_micro_batch).

    Token sums: pg_clipfrac (the picked tokens), kl_cov_penalty (|logp - old| of the picked tokens, before
    kl_coef), ppo_kl (old - new log-prob over all tokens; verl reports |logp - old| there instead).
    """
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(log_probs, old_log_probs, mask)
    advantages = token_advantages(advantages, mask)
    covariance = _token_covariance(log_probs, advantages, mask)
    picked = _picked_first(-covariance, _pick_count(config.ratio, mask))
    penalty = torch.where(picked, log_ratio.abs(), 0.0)
    per_token = -advantages * torch.exp(log_ratio) + config.kl_coef * penalty
    stats = token_stats(mask, log_ratio, pg_clipfrac=picked, kl_cov_penalty=penalty)
    return weighted_aggregate(per_token, mask, actor.loss_agg_mode, scale, importance_weights), stats
