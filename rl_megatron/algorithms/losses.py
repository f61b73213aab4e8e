"""PPO policy and value losses, and the parts every policy loss shares (masked log-ratio, clipped surrogate, stats),
aggregated so micro-batch losses sum to the mini-batch loss.

Every micro-batch divides by the sizes of the whole mini-batch (LossScale, summed over data-parallel ranks), so the
losses of its micro-batches on all ranks add up to the mini-batch aggregate whatever the split. Their `LossStats`
add up the same way: sums over response tokens, divided by the token count only at the end.
"""
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl_megatron.algorithms.masked import masked_sum
from rl_megatron.batch import to_device
from rl_megatron.config.choices import LOSS_AGG_MODES

# Keeps exp() finite (float32 overflows near e^88); a ratio of e^20 is already far outside any clip range.
_MAX_ABS_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossScale:
    """Sizes of the whole mini-batch, over all data-parallel ranks, that each micro-batch's loss is divided by."""

    tokens: float  # response tokens in the mini-batch
    sequences: float  # sequences in the mini-batch
    horizon: int  # the constant length Dr.GRPO divides by: the generation budget (max response tokens)


@dataclass
class LossStats:
    """What a micro-batch's loss reports, detached, to be added up over micro-batches and data-parallel ranks:
    `token_sums` are sums over its response tokens (reported divided by the total of `tokens`), `losses` are its
    shares of normalised losses (reported averaged over optimizer steps)."""

    tokens: Tensor | float  # response tokens in the micro-batch
    token_sums: dict[str, Tensor | float]
    losses: dict[str, Tensor | float] = field(default_factory=dict)

    def add(self, other: "LossStats") -> None:
        """Add `other`'s figures to these in float64, where they are: on the device, read back once per update
        rather than once per micro-batch (a host sync each)."""
        self.tokens = _float64(self.tokens) + _float64(other.tokens)
        for mine, theirs in ((self.token_sums, other.token_sums), (self.losses, other.losses)):
            for key, value in theirs.items():
                mine[key] = _float64(mine.get(key, 0.0)) + _float64(value)

    def figures(self, device: torch.device) -> tuple[list[str], list[str], Tensor]:
        """(token-sum keys, loss keys, every figure in one float64 tensor on `device`: tokens, the token sums, the
        losses, in that order), ready for one reduction and one read-back."""
        sum_keys, loss_keys = sorted(self.token_sums), sorted(self.losses)
        values = [self.tokens, *(self.token_sums[k] for k in sum_keys), *(self.losses[k] for k in loss_keys)]
        return sum_keys, loss_keys, torch.stack([to_device(torch.as_tensor(v, dtype=torch.float64), device)
                                                  for v in values])


def _float64(value: Tensor | float) -> Tensor | float:
    return value.double() if isinstance(value, Tensor) else value


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str, scale: LossScale) -> Tensor:
    """This micro-batch's share of the mini-batch loss under `mode` (one of LOSS_AGG_MODES)."""
    per_token = per_token.float()
    if mode == "token-mean":
        return masked_sum(per_token, mask) / scale.tokens
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token, mask) / scale.sequences
    if mode == "seq-mean-token-mean":
        row_tokens = mask.bool().sum(dim=1).clamp(min=1)  # an empty row contributes 0 instead of 0 / 0
        return (masked_sum(per_token, mask, dim=1) / row_tokens).sum() / scale.sequences
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(per_token, mask) / (scale.sequences * scale.horizon)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


def _masked_count(condition: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(condition.float(), mask).detach()


def masked_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) per token, in float32: 0 outside the mask, so that padding (which may hold inf or NaN) can
    never turn into an inf ratio or a NaN gradient, and within +-20 so that its exp() stays finite."""
    log_ratio = torch.where(mask.bool(), log_probs.float() - old_log_probs.float(), 0.0)
    return log_ratio.clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """[B, S] float advantages (a [B] one spread over its row's tokens), 0 outside the mask."""
    advantages = advantages.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return torch.where(mask.bool(), advantages, 0.0)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float,
                      clip_ratio_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's per-token loss max(-A r, -A clip(r, 1 - low, 1 + high)), capped at -A c where A < 0 with dual-clip;
    and where it took the clipped term and where the cap (neither has a gradient in r)."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        # With A < 0 the pessimistic term grows without bound in the ratio; dual-clip caps it at -A * c.
        cap = -advantages * clip_ratio_c
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    return per_token, clipped > unclipped, dual_clipped


def weighted_aggregate(per_token: Tensor, mask: Tensor, mode: str, scale: LossScale,
                       importance_weights: Tensor | None) -> Tensor:
    """`aggregate_loss` of the per-token loss times the rollout correction's per-token weights (if any)."""
    if importance_weights is not None:
        per_token = per_token * importance_weights
    return aggregate_loss(per_token, mask, mode, scale)


def token_stats(mask: Tensor, log_ratio: Tensor, **token_values: Tensor) -> LossStats:
    """A policy loss's stats: the response tokens, ppo_kl (old - new log-prob) and each of `token_values` (a
    condition counts its tokens), summed over the response tokens."""
    sums = {name: masked_sum(values.float(), mask).detach() for name, values in token_values.items()}
    return LossStats(tokens=_masked_count(mask, mask),
                     token_sums={**sums, "ppo_kl": masked_sum(-log_ratio, mask).detach()})


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    agg_mode: str,
    scale: LossScale,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """PPO clipped surrogate with ratio range [1 - low, 1 + high], optional dual-clip (cap -A * c where A < 0) and
    optional per-token importance weights; advantages are [B, S] or [B]. Token sums: pg_clipfrac (clipped tokens),
    pg_clipfrac_lower (dual-clipped tokens), ppo_kl (old - new log-prob)."""
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(log_probs, old_log_probs, mask)
    per_token, clipped, dual_clipped = clipped_surrogate(torch.exp(log_ratio), token_advantages(advantages, mask),
                                                         clip_ratio_low, clip_ratio_high, clip_ratio_c)
    stats = token_stats(mask, log_ratio, pg_clipfrac=clipped, pg_clipfrac_lower=dual_clipped)
    return weighted_aggregate(per_token, mask, agg_mode, scale, importance_weights), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    agg_mode: str,
    scale: LossScale,
) -> tuple[Tensor, LossStats]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2), aggregated like the policy loss.
    Token sums: vf_clipfrac (tokens where the clipped error is larger), vpred (v)."""
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    stats = LossStats(tokens=_masked_count(response_mask, response_mask), token_sums={
        "vf_clipfrac": _masked_count(clipped_error > unclipped_error, response_mask),
        "vpred": masked_sum(values, response_mask).detach(),
    })
    return aggregate_loss(per_token, response_mask, agg_mode, scale), stats


def megatron_loss_factor(micro_batches: int, data_parallel: int, context_parallel: int) -> float:
    """What each micro-batch's loss (its share of the mini-batch loss) is multiplied by before Megatron's schedule, so
    that the gradient every rank holds after DDP is that of the mini-batch loss. Megatron 0.16.1's schedule multiplies
    the loss by CP / micro_batches and DDP averages the gradients over the DP x CP ranks, both made for CP ranks whose
    losses each cover their own tokens; here every CP rank computes the whole loss, on rows gathered from the CP group
    by an all-gather whose backward sums the CP ranks' gradients: CP times the gradient, which the factor divides."""
    return micro_batches * data_parallel / context_parallel
