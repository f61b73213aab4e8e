"""On-policy distillation (Agarwal et al. 2024; Thinking Machines, "On-Policy Distillation", 2025): the policy samples,
a frozen teacher scores the sampled tokens, and each token's advantage is the teacher's log-prob of it minus the
policy's, the negative of a one-sample estimate of the per-token reverse KL(policy || teacher). Undiscounted and
per token: a token is credited with its own term only (Thinking Machines' discount factor of zero), so the policy
learns where the teacher disagrees, token by token, instead of from one outcome per answer.

With algorithm.distillation.top_k the teacher gives its k likeliest tokens at each response position and the
policy learns their distribution as a loss term (`top_k_kl`, NeMo-RL's distillation loss, forward KL): a signal at
every position over k tokens, not the one sampled, where a sampled token says little (short answers; a teacher
whose likeliest answer the student rarely samples). The term is the actor's loss, not an advantage: mixed, the task's
advantages train beside it; alone, nothing else does.

The sampled-token term enters the advantages in one of two modes (algorithm.distillation.mode): alone, the whole advantage; or mixed,
added to the task's advantages (algorithm.adv_estimator's, from the rewards), weighted by algorithm.distillation.coef.
The policy's log-probs are the old ones (before the step's update): the ratio's denominator, which the advantage is
measured against.
"""
from __future__ import annotations

from torch import Tensor

from rl_megatron.algorithms.masked import masked_mean


def distillation_advantages(task_advantages: Tensor | None, teacher_log_probs: Tensor, log_probs: Tensor,
                            response_mask: Tensor, coef: float) -> Tensor:
    """[B, S] advantages: `task_advantages` ([B, S]; None: distillation alone) + coef x (log p_teacher - log p_policy)
    at every response token, 0 outside `response_mask`."""
    mask = response_mask.bool()
    distillation = (teacher_log_probs.float() - log_probs.float()).masked_fill(~mask, 0.0) * coef
    return distillation if task_advantages is None else task_advantages.float().masked_fill(~mask, 0.0) + distillation


def reverse_kl(log_probs: Tensor, teacher_log_probs: Tensor, response_mask: Tensor) -> float:
    """The mean over response tokens of log p_policy - log p_teacher: the sampled estimate of the per-token reverse
    KL(policy || teacher) that distillation drives down (distill/reverse_kl)."""
    return masked_mean(log_probs.float() - teacher_log_probs.float(), response_mask).item()


def top_k_kl(teacher_top_log_probs: Tensor, top_log_probs: Tensor) -> Tensor:
    """[B, S]: at each position, sum over the teacher's k likeliest tokens of p_teacher (log p_teacher - log p_policy),
    the forward KL(teacher || policy) restricted to them (the teacher's mass beyond them ignored, as NeMo-RL's
    top-k distillation does); its gradient in the policy is -sum_k p_teacher(k) grad log p_policy(k).
    teacher_top_log_probs, top_log_probs: [B, S, k], the teacher's and the policy's log-probs of those tokens."""
    teacher = teacher_top_log_probs.float()
    return (teacher.exp() * (teacher - top_log_probs.float())).sum(dim=-1)
