"""Advantage estimators: GAE (with a critic) and the critic-free GRPO, RLOO and REINFORCE++ variants, registered by
name (`algorithm.adv_estimator`); a user's own register with `@register_adv_estimator(name, needs_critic=...)`, and
with `config=` a dataclass of its own keys (section algorithm.<name>), which it gets as the keyword `config`."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rl_megatron.algorithms.masked import masked_sum, masked_whiten
from rl_megatron.registry import Registry


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads: [B, S] token rewards (the outcome score at the last response token, minus the
    in-reward KL penalty when on), the response mask, each row's prompt group [B], the critic's values [B, S] (with a
    critic), and the algorithm section's gamma, lam and norm_adv_by_std."""
    token_rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor
    values: Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True

    def scores(self) -> Tensor:
        """Each row's score: its token rewards summed over the response (so an in-reward KL penalty counts)."""
        return masked_sum(self.token_rewards.float(), self.response_mask, dim=1)


# estimator(inputs) -> (advantages [B, S], returns [B, S] or None), 0 outside the mask
AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]
ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "algorithm.adv_estimator",
    "register yours with @rl_megatron.algorithms.register_adv_estimator({name!r}) in a module listed in "
    "trainer.imports")


def register_adv_estimator(name: str, needs_critic: bool = False, config: type | None = None):
    """Register an estimator `fn(AdvantageInputs) -> (advantages, returns or None)` under `name`; one that
    `needs_critic` gets the critic's values (and the critic trains on its returns); with `config` (the dataclass of its
    own keys, section algorithm.<name>) it is called as `fn(inputs, config=...)`."""
    return ADV_ESTIMATORS.register(name, config=config, needs_critic=needs_critic)


def needs_critic(estimator: str) -> bool:
    return ADV_ESTIMATORS.trait(estimator, "needs_critic", False)


def outcome_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[B, S] rewards holding each row's score at its last response token (a row without one gets nothing)."""
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last_response_position = torch.where(mask, positions, -1).max(dim=1, keepdim=True).values
    return torch.where(mask & (positions == last_response_position), scores.float().unsqueeze(1), 0.0)


def _broadcast_over_response(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    return torch.where(response_mask.bool(), per_sequence.float().unsqueeze(1), 0.0)


def _group_sums_and_sizes(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each sample: the sum of `values` over its group, and the group's size."""
    group_keys, group_index = torch.unique(group_ids, return_inverse=True)
    sums = values.new_zeros(group_keys.numel()).index_add_(0, group_index, values)
    sizes = values.new_zeros(group_keys.numel()).index_add_(0, group_index, torch.ones_like(values))
    return sums[group_index], sizes[group_index]


def grpo_advantages(scores: Tensor, group_ids: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Each score relative to the other samples of its prompt: (s - mean) / (std + eps), std unbiased.

    Without norm_by_std only the group mean is subtracted (Dr.GRPO). A lone sample gets 0.
    """
    scores = scores.float()
    group_sums, group_sizes = _group_sums_and_sizes(scores, group_ids)
    centered = scores - group_sums / group_sizes
    if not norm_by_std:
        return centered
    squared_deviation_sums, _ = _group_sums_and_sizes(centered**2, group_ids)
    # The clamp turns a lone sample's 0/0 variance into 0, so its advantage is 0 / eps = 0, not NaN.
    std = (squared_deviation_sums / (group_sizes - 1).clamp(min=1)).sqrt()
    return centered / (std + eps)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Score minus the mean score of the other samples of its group (leave-one-out); a lone sample gets 0."""
    scores = scores.float()
    group_sums, group_sizes = _group_sums_and_sizes(scores, group_ids)
    # s - (sum - s) / (n - 1) = (n s - sum) / (n - 1); for a lone sample the numerator is exactly 0.
    return (group_sizes * scores - group_sums) / (group_sizes - 1).clamp(min=1)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE over response positions (value after the last one is 0): (advantages whitened over the batch,
    returns = raw advantages + values), both 0 outside the mask."""
    token_rewards, values, mask = token_rewards.float(), values.float(), response_mask.bool()
    raw_advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        advantage = token_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        # A masked position is no step of the episode: the recursion carries over it unchanged.
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        raw_advantages[:, t] = torch.where(mask[:, t], advantage, 0.0)
    returns = torch.where(mask, raw_advantages + values, 0.0)
    return masked_whiten(raw_advantages, mask), returns


def reinforce_plus_plus_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """returns = discounted sum of the future token rewards of the response; advantages = whitened returns."""
    token_rewards, mask = token_rewards.float(), response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    future_return = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        future_return = torch.where(mask[:, t], token_rewards[:, t] + gamma * future_return, future_return)
        returns[:, t] = torch.where(mask[:, t], future_return, 0.0)
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline_advantages(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """(score - group mean) on each of the row's response tokens, whitened over the batch's response tokens."""
    centered = grpo_advantages(scores, group_ids, norm_by_std=False)
    return masked_whiten(_broadcast_over_response(centered, response_mask), response_mask)


def compute_advantages(estimator: str, inputs: AdvantageInputs, extension_keys: Mapping[str, Any] | None = None
                       ) -> tuple[Tensor, Tensor | None]:
    """(advantages [B, S], returns [B, S] or None) of the registered `estimator`, 0 outside the mask; its own keys,
    if it has them, from `extension_keys` (the config's)."""
    return ADV_ESTIMATORS.bound(estimator, extension_keys or {})(inputs)


@register_adv_estimator("gae", needs_critic=True)
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.values is None:
        raise ValueError("the gae advantage estimator needs the critic's values")
    return gae_advantages(inputs.token_rewards, inputs.values, inputs.response_mask, inputs.gamma, inputs.lam)


@register_adv_estimator("grpo")
def _grpo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    per_sequence = grpo_advantages(inputs.scores(), inputs.group_ids, inputs.norm_by_std)
    return _broadcast_over_response(per_sequence, inputs.response_mask), None


@register_adv_estimator("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    return _broadcast_over_response(rloo_advantages(inputs.scores(), inputs.group_ids), inputs.response_mask), None


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return reinforce_plus_plus_advantages(inputs.token_rewards, inputs.response_mask, inputs.gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    return reinforce_plus_plus_baseline_advantages(inputs.scores(), inputs.group_ids, inputs.response_mask), None
