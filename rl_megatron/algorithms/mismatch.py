"""Mismatch between the rollout engine's log-probs (vLLM) and the trainer's for the same tokens, and its correction."""
import math

import torch
from torch import Tensor

from rl_megatron.algorithms.masked import masked_mean


def rollout_mismatch_metrics(
    train_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """exp of the mean |train - rollout| log-prob difference over response tokens (1 when both agree), that mean
    and the max."""
    abs_diff = torch.where(response_mask.bool(), (train_log_probs.float() - rollout_log_probs.float()).abs(), 0.0)
    mean_abs_diff = masked_mean(abs_diff, response_mask)
    return {
        "mismatch/token_mult_prob_error": torch.exp(mean_abs_diff).item(),
        "mismatch/max_abs_logprob_diff": abs_diff.max().item(),
        "mismatch/mean_abs_logprob_diff": mean_abs_diff.item(),
    }


def rollout_correction_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str, mode: str, threshold: float
) -> Tensor:
    """Detached weights [B, S] of the policy gradient correcting for sampling from the rollout engine (a stale policy,
    or the engine's numerics), 0 outside the response mask. No host sync: the on-policy update computes them in its
    loss, a micro-batch at a time (a sample's tokens are all in one).

    The ratio p_train / p_rollout, with m_t the response mask:
        level=token:    r_t = exp(old_t - rollout_t)
        level=sequence: r = exp(sum_t m_t (old_t - rollout_t)), the same for all the sequence's tokens
    and the weight, with T the threshold:
        mode=truncate (TIS): w = min(r, T)
        mode=mask (MIS):     w = r if r <= T else 0 (the token, or the whole sequence, out of the gradient)
    The log ratio is compared with log T and only exp(min(log r, log T)) is taken, so a long sequence's sum never
    overflows.
    """
    return _weights(old_log_probs, rollout_log_probs, response_mask, level, mode, threshold)[0]


def rollout_correction_metrics(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str, mode: str, threshold: float
) -> dict[str, float]:
    """The mean of `rollout_correction_weights` over the response tokens, and the share of those tokens whose ratio
    is past the threshold (capped, or masked)."""
    weights, over = _weights(old_log_probs, rollout_log_probs, response_mask, level, mode, threshold)
    fraction = "capped_fraction" if mode == "truncate" else "masked_fraction"
    return {
        "rollout_corr/weight_mean": masked_mean(weights, response_mask).item(),
        f"rollout_corr/{fraction}": masked_mean(over.float(), response_mask).item(),
    }


def _weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str, mode: str, threshold: float
) -> tuple[Tensor, Tensor]:
    """(`rollout_correction_weights`, where the ratio is past the threshold)."""
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        raise ValueError(f"unknown rollout correction level={level!r} mode={mode!r}; known: token|sequence, "
                         "truncate|mask")
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_log_probs.detach().float() - rollout_log_probs.detach().float(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    log_threshold = math.log(threshold)
    over = mask & (log_ratio > log_threshold)
    within = torch.exp(log_ratio.clamp(max=log_threshold))
    weights = torch.where(over, threshold if mode == "truncate" else 0.0, within)
    return torch.where(mask, weights, 0.0), over
