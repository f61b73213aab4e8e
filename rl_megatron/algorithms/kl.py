"""KL estimators between policy and reference model, the in-reward KL penalty and its coefficient controllers."""
import torch
from torch import Tensor

from rl_megatron.algorithms.masked import masked_mean
from rl_megatron.config.choices import KL_ESTIMATORS

# k3 is exp(x) - x - 1 with x = ref - logp: it is far past the [-10, 10] clamp once |x| > 20, and capping x there keeps
# exp() finite, so the clamped values get 0 gradients instead of 0 * inf = NaN.
_K3_MAX_ABS_LOG_RATIO = 20.0
_K3_BOUND = 10.0


def kl_divergence(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman's k1/k2/k3).

    mse is k2 and low_var_kl is k3 (k3 clamped to [-10, 10] for stability)."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * log_ratio**2
    if estimator in ("k3", "low_var_kl"):
        ref_over_policy = (-log_ratio).clamp(-_K3_MAX_ABS_LOG_RATIO, _K3_MAX_ABS_LOG_RATIO)
        return (torch.exp(ref_over_policy) - ref_over_policy - 1).clamp(-_K3_BOUND, _K3_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def apply_kl_penalty(
    token_rewards: Tensor, log_probs: Tensor, ref_log_probs: Tensor, response_mask: Tensor, coef: float, estimator: str
) -> tuple[Tensor, float]:
    """(token rewards minus coef * per-token KL on response tokens, mean per-token KL over response tokens)."""
    kl = torch.where(response_mask.bool(), kl_divergence(log_probs, ref_log_probs, estimator), 0.0)
    return token_rewards.float() - coef * kl, masked_mean(kl, response_mask).item()


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards target_kl (Ziegler et al., 2019)."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int):
        self.value = init_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Grow the coefficient while the KL is above target, shrink it below, by at most 20% per horizon."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, coef: float, target_kl: float, horizon: int) -> FixedKLController | AdaptiveKLController:
    """The "fixed" or "adaptive" KL coefficient controller starting at `coef`."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: fixed, adaptive")
