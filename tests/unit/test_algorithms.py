import math

import pytest
import torch

from rl_megatron.algorithms import grpo_advantages, masked_mean, masked_sum, ppo_clip_policy_loss

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_over_all_tokens():
    # 1 + 2 + 4 = 7 over 3 tokens
    assert masked_sum(VALUES, MASK).item() == 7.0
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)


def test_masked_sum_and_mean_per_row_with_bool_mask():
    bool_mask = MASK.bool()
    # row 0: 1 + 2 = 3 over 2 tokens; row 1: 4 over 1 token
    assert masked_sum(VALUES, bool_mask, dim=1).tolist() == [3.0, 4.0]
    assert masked_mean(VALUES, bool_mask, dim=1).tolist() == [1.5, 4.0]


def test_grpo_advantages_with_interleaved_groups():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, deviations +-0.5,
    #   unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # Group 3: rewards 1, 0, 0, 0 -> mean 0.25, deviations 0.75, -0.25 x3,
    #   var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std = 0.5 -> 1.5, -0.5, -0.5, -0.5
    # Group 5: all 1 -> every deviation is 0 -> advantage 0
    group_ids = torch.tensor([7, 3, 5, 3, 7, 5, 3, 7, 5, 7, 3, 5])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    expected = torch.tensor(
        [0.866025, 1.5, 0.0, -0.5, -0.866025, 0.0, -0.5, -0.866025, 0.0, 0.866025, -0.5, 0.0]
    )
    torch.testing.assert_close(grpo_advantages(rewards, group_ids), expected, atol=1e-5, rtol=0)


def test_grpo_advantages_two_sample_group():
    # rewards 2, 0 -> mean 1, deviations +-1, var = 2 / 1 = 2, std = 1.414214 -> +-0.707107
    advantages = grpo_advantages(torch.tensor([2.0, 0.0]), torch.tensor([0, 0]))
    torch.testing.assert_close(advantages, torch.tensor([0.707107, -0.707107]), atol=1e-5, rtol=0)


def test_grpo_advantages_without_std_normalization_only_centers():
    # Group 0: 1, 0, 0, 0 -> mean 0.25 -> 0.75, -0.25, -0.25, -0.25
    # Group 1: 3, 1 -> mean 2 -> 1, -1
    group_ids = torch.tensor([0, 1, 0, 0, 1, 0])
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 0.0])
    advantages = grpo_advantages(rewards, group_ids, norm_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([0.75, 1.0, -0.25, -0.25, -1.0, -0.25]))


def test_grpo_advantages_single_sample_groups_are_zero():
    advantages = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([4, 9]))
    assert advantages.tolist() == [0.0, 0.0]
    assert not torch.isnan(advantages).any()


def _log_probs_for_ratios(old_log_probs: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    return old_log_probs + torch.tensor(ratios).log()


def test_policy_loss_inside_and_outside_clip_for_both_advantage_signs():
    old = torch.full((2, 3), -1.0)
    ratios = [[1.1, 1.5, 0.5], [1.5, 0.5, 0.9]]
    log_probs = _log_probs_for_ratios(old, ratios)
    advantages = torch.tensor([1.0, -1.0])  # one per sequence, broadcast over its tokens
    loss, stats = ppo_clip_policy_loss(log_probs, old, advantages, torch.ones(2, 3), 0.2, 0.2, 6)
    # Clip range [0.8, 1.2]; per-token loss = max(-A * r, -A * clip(r)):
    #   A=+1: r=1.1 -> max(-1.1, -1.1) = -1.1   inside
    #         r=1.5 -> max(-1.5, -1.2) = -1.2   clipped
    #         r=0.5 -> max(-0.5, -0.8) = -0.5   unclipped (pessimistic side)
    #   A=-1: r=1.5 -> max( 1.5,  1.2) =  1.5   unclipped (pessimistic side)
    #         r=0.5 -> max( 0.5,  0.8) =  0.8   clipped
    #         r=0.9 -> max( 0.9,  0.9) =  0.9   inside
    # sum = -2.8 + 3.2 = 0.4; loss = 0.4 / 6
    assert loss.item() == pytest.approx(0.4 / 6, abs=1e-6)
    assert stats["pg_loss_sum"].item() == pytest.approx(0.4, abs=1e-6)
    assert stats["pg_clipfrac_sum"].item() == 2.0
    # sum(old - new) = -sum(log r) = -log(1.1 * 1.5 * 0.5 * 1.5 * 0.5 * 0.9) = -log(0.556875)
    assert stats["ppo_kl_sum"].item() == pytest.approx(-math.log(0.556875), abs=1e-5)
    assert stats["tokens"].item() == 6.0


def test_policy_loss_ignores_padding_with_variable_response_lengths():
    old = torch.zeros(2, 4)
    # Padding positions carry wild values that must not leak into the loss or stats.
    ratios = [[1.1, 0.9, 50.0, 50.0], [1.5, 1.0, 0.5, 50.0]]
    log_probs = _log_probs_for_ratios(old, ratios)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    advantages = torch.tensor([[2.0, 2.0, 99.0, 99.0], [-1.0, -1.0, -1.0, 99.0]])  # per token
    loss, stats = ppo_clip_policy_loss(log_probs, old, advantages, mask, 0.2, 0.2, 5)
    # Row 0, A=2: r=1.1 -> -2.2; r=0.9 -> -1.8                          sum -4.0
    # Row 1, A=-1: r=1.5 -> max(1.5, 1.2) = 1.5; r=1.0 -> 1.0;
    #              r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)               sum  3.3
    # total -0.7 over 5 tokens
    assert loss.item() == pytest.approx(-0.7 / 5, abs=1e-6)
    assert stats["pg_clipfrac_sum"].item() == 1.0
    # -log(1.1 * 0.9 * 1.5 * 1.0 * 0.5) = -log(0.7425)
    assert stats["ppo_kl_sum"].item() == pytest.approx(-math.log(0.7425), abs=1e-5)
    assert stats["tokens"].item() == 5.0


def test_policy_loss_asymmetric_clip_range():
    old = torch.zeros(2, 2)
    log_probs = _log_probs_for_ratios(old, [[1.25, 1.5], [0.75, 1.25]])
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = ppo_clip_policy_loss(log_probs, old, advantages, torch.ones(2, 2), 0.2, 0.28, 4)
    # Clip range [0.8, 1.28]:
    #   A=+1: r=1.25 -> -1.25 (inside the higher upper bound); r=1.5 -> max(-1.5, -1.28) = -1.28
    #   A=-1: r=0.75 -> max(0.75, 0.8) = 0.8 (clipped);       r=1.25 -> 1.25
    # sum = -2.53 + 2.05 = -0.48; loss = -0.48 / 4 = -0.12
    assert loss.item() == pytest.approx(-0.12, abs=1e-6)
    assert stats["pg_clipfrac_sum"].item() == 2.0


def test_policy_loss_gradient_vanishes_on_clipped_tokens():
    old = torch.zeros(1, 2)
    log_probs = _log_probs_for_ratios(old, [[1.1, 1.5]]).requires_grad_()
    loss, _ = ppo_clip_policy_loss(log_probs, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2, 2)
    loss.backward()
    # Inside: d(-A * exp(lp - old)) / d lp / 2 = -1.1 / 2; clipped: constant -> 0
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.55, 0.0]]))


def test_policy_loss_micro_batches_sum_to_full_batch_loss():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(6, 5, generator=generator)
    log_probs = old + 0.5 * torch.randn(6, 5, generator=generator)
    advantages = torch.randn(6, generator=generator)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(5) < lengths.unsqueeze(1)).float()
    normalizer = mask.sum()  # tokens of the whole mini-batch

    full_loss, full_stats = ppo_clip_policy_loss(log_probs, old, advantages, mask, 0.2, 0.28, normalizer)
    micro_losses, micro_stats = zip(
        *(
            ppo_clip_policy_loss(
                log_probs[rows], old[rows], advantages[rows], mask[rows], 0.2, 0.28, normalizer
            )
            for rows in (slice(0, 2), slice(2, 6))
        )
    )
    torch.testing.assert_close(sum(micro_losses), full_loss)
    torch.testing.assert_close(full_loss, full_stats["pg_loss_sum"] / full_stats["tokens"])
    for key, full_value in full_stats.items():
        torch.testing.assert_close(sum(stats[key] for stats in micro_stats), full_value)
