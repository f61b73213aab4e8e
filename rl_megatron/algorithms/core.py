"""Pure tensor math of GRPO/PPO: masked reductions, group-relative advantages, clipped policy loss."""
import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    weighted = values * mask.to(values.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    mask = mask.to(values.dtype)
    token_count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / token_count


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Each reward relative to the other samples of its prompt: (r - mean) / (std + eps).

    Without norm_by_std only the group mean is subtracted (Dr.GRPO). A lone sample gets 0.
    """
    rewards = rewards.float()
    group_keys, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = group_keys.numel()
    counts = rewards.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(rewards))
    sums = rewards.new_zeros(num_groups).index_add_(0, group_index, rewards)
    centered = rewards - (sums / counts)[group_index]
    if not norm_by_std:
        return centered
    squared_deviation_sums = rewards.new_zeros(num_groups).index_add_(0, group_index, centered**2)
    # Unbiased (n - 1) like torch.std. The clamp turns a lone sample's 0/0 into 0/1, so its
    # advantage stays 0 / (0 + eps) = 0 instead of NaN.
    std = (squared_deviation_sums / (counts - 1).clamp(min=1)).sqrt()
    return centered / (std[group_index] + eps)


def ppo_clip_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_normalizer: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss summed over masked tokens and divided by loss_normalizer.

    With loss_normalizer = response tokens of the whole mini-batch, the sum of the returned losses
    over its micro-batches is the mini-batch token-mean. The stats are detached plain sums so the
    caller can add them across micro-batches before dividing by `tokens`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token_loss = torch.maximum(unclipped_loss, clipped_loss)
    loss_sum = masked_sum(per_token_loss, mask)
    stats = {
        "pg_loss_sum": loss_sum.detach(),
        "pg_clipfrac_sum": masked_sum((clipped_loss > unclipped_loss).to(mask.dtype), mask).detach(),
        "ppo_kl_sum": masked_sum(-log_ratio, mask).detach(),
        "tokens": mask.sum().detach(),
    }
    return loss_sum / loss_normalizer, stats
