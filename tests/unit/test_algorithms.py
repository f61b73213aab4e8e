"""The RL math against hand-worked values: advantages, losses and their aggregation, KL, rollout mismatch.

Most tests use RESPONSE_MASK: a prompt before each response, padding after it, rows of 3, 2, 1 and 0 response tokens.
Positions outside the mask hold NaN (or other garbage) wherever the result must not depend on them.
"""
import math

import pytest
import torch

from rl_megatron.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    LossScale,
    LossStats,
    aggregate_loss,
    apply_kl_penalty,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    kl_controller,
    kl_divergence,
    masked_mean,
    masked_sum,
    masked_whiten,
    needs_critic,
    outcome_token_rewards,
    policy_loss,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    rollout_mismatch_metrics,
    value_loss,
)

NAN = float("nan")
RESPONSE_MASK = torch.tensor([
    [0, 0, 1, 1, 1],  # prompt of 2, response of 3
    [0, 1, 1, 0, 0],  # prompt of 1, response of 2, padding of 2
    [0, 0, 0, 1, 0],  # prompt of 3, response of 1, padding of 1
    [0, 0, 0, 0, 0],  # prompt of 2 and an empty response
])
TOKEN_MEAN_OF_6 = LossScale(tokens=6, sequences=4, horizon=5)


def on_response(row_values: list[list[float]], fill: float = 0.0, mask: torch.Tensor = RESPONSE_MASK) -> torch.Tensor:
    """A [B, S] tensor with each row's values on its response positions and `fill` everywhere else."""
    out = torch.full(mask.shape, fill)
    for row, values in enumerate(row_values):
        out[row, mask[row].bool()] = torch.tensor(values, dtype=torch.float32)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor | list) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=1e-5, rtol=0)


# --- masked reductions ---------------------------------------------------------------------------------------------

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


def test_masked_sum_ignores_non_finite_values_outside_the_mask():
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), -float("inf")]])
    assert masked_sum(values, MASK).item() == 7.0


def test_masked_whiten_uses_unbiased_variance_of_masked_entries_only():
    values = on_response([[1.0, 3.0, 5.0], [7.0], [], []], fill=NAN, mask=torch.tensor(
        [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]))
    mask = ~values.isnan()
    # 1, 3, 5, 7: mean 4, deviations -3, -1, 1, 3, unbiased var = (9 + 1 + 1 + 9) / 3 = 20/3, std = 2.581989
    #   -> -1.161895, -0.387298, 0.387298, 1.161895; everything else 0
    expected = torch.zeros(4, 5)
    expected[0, :3] = torch.tensor([-1.161895, -0.387298, 0.387298])
    expected[1, 0] = 1.161895
    assert_close(masked_whiten(values, mask), expected)


def test_masked_whiten_of_one_or_no_entry_is_zero():
    one_entry = torch.tensor([[0, 1, 0]])
    assert masked_whiten(torch.tensor([[NAN, 5.0, NAN]]), one_entry).tolist() == [[0.0, 0.0, 0.0]]
    assert masked_whiten(torch.tensor([[NAN, 5.0, NAN]]), torch.zeros(1, 3)).tolist() == [[0.0, 0.0, 0.0]]


# --- advantages ----------------------------------------------------------------------------------------------------

def test_outcome_token_rewards_puts_each_score_on_the_last_response_token():
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), RESPONSE_MASK)
    assert rewards.tolist() == [
        [0, 0, 0, 0, 1.0],
        [0, 0, 2.0, 0, 0],  # response ends at position 2, before the padding
        [0, 0, 0, 3.0, 0],
        [0, 0, 0, 0, 0],  # empty response: the score has nowhere to go
    ]


def test_grpo_advantages_with_interleaved_groups():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, deviations +-0.5,
    #   unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # Group 3: rewards 1, 0, 0, 0 -> mean 0.25, deviations 0.75, -0.25 x3,
    #   var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std = 0.5 -> 1.5, -0.5, -0.5, -0.5
    # Group 5: all 1 -> every deviation is 0 -> advantage 0
    group_ids = torch.tensor([7, 3, 5, 3, 7, 5, 3, 7, 5, 7, 3, 5])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    expected = [0.866025, 1.5, 0.0, -0.5, -0.866025, 0.0, -0.5, -0.866025, 0.0, 0.866025, -0.5, 0.0]
    assert_close(grpo_advantages(rewards, group_ids), expected)


def test_grpo_advantages_two_sample_group():
    # rewards 2, 0 -> mean 1, deviations +-1, var = 2 / 1 = 2, std = 1.414214 -> +-0.707107
    advantages = grpo_advantages(torch.tensor([2.0, 0.0]), torch.tensor([0, 0]))
    assert_close(advantages, [0.707107, -0.707107])


def test_grpo_advantages_without_std_normalization_only_centers():
    # Group 0: 1, 0, 0, 0 -> mean 0.25 -> 0.75, -0.25, -0.25, -0.25
    # Group 1: 3, 1 -> mean 2 -> 1, -1
    group_ids = torch.tensor([0, 1, 0, 0, 1, 0])
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 0.0])
    advantages = grpo_advantages(rewards, group_ids, norm_by_std=False)
    assert_close(advantages, [0.75, 1.0, -0.25, -0.25, -1.0, -0.25])


def test_grpo_advantages_single_sample_groups_are_zero():
    advantages = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([4, 9]))
    assert advantages.tolist() == [0.0, 0.0]


def test_rloo_advantages_subtract_the_mean_of_the_other_samples():
    # Group 0: 1, 0, 0, 1 -> a 1 faces others (0 + 0 + 1) / 3 -> 2/3; a 0 faces (1 + 0 + 1) / 3 -> -2/3
    # Group 1: 3, 1 -> 3 - 1 = 2, 1 - 3 = -2.   Group 2: a lone 5 -> 0
    group_ids = torch.tensor([0, 1, 0, 2, 0, 1, 0])
    scores = torch.tensor([1.0, 3.0, 0.0, 5.0, 0.0, 1.0, 1.0])
    assert_close(rloo_advantages(scores, group_ids), [2 / 3, 2.0, -2 / 3, 0.0, -2 / 3, -2.0, 2 / 3])


def test_gae_skips_masked_positions_and_whitens_over_the_batch():
    # Row 2 has a masked hole at position 2 (e.g. a tool's output): the recursion must step over it.
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    values = on_response([[1.0, 0.5, 0.25], [0.5, 1.0], [2.0, 1.0], []], fill=9.0, mask=mask)
    rewards = on_response([[0.0, 0.0, 1.0], [0.0, 2.0], [0.0, 2.0], []], fill=7.0, mask=mask)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    # gamma * lam = 0.25; delta_t = r_t + 0.5 * V_next - V_t; A_t = delta_t + 0.25 * A_next; V, A after the end = 0
    # Row 0: A4 = 1 - 0.25 = 0.75; A3 = (0.125 - 0.5) + 0.25 * 0.75 = -0.1875
    #        A2 = (0.25 - 1) + 0.25 * -0.1875 = -0.796875
    # Row 1: A2 = 2 - 1 = 1; A1 = (0.5 - 0.5) + 0.25 * 1 = 0.25
    # Row 2: A3 = 2 - 1 = 1; A1 = (0.5 * V3 - 2) + 0.25 * A3 = -1.5 + 0.25 = -1.25   (V3 = 1, not the hole's 9)
    # returns = A + V
    assert_close(returns, on_response([[0.203125, 0.3125, 1.0], [0.75, 2.0], [0.75, 2.0], []], mask=mask))
    # Whitening the 7 raw advantages, in 64ths: -51, -12, 48, 16, 64, -80, 64; mean 7/64
    #   deviations -58, -19, 41, 9, 57, -87, 57; squares sum 19554 -> unbiased var 3259 / 64^2
    #   whitened = deviation / sqrt(3259) = deviation / 57.087652
    expected = on_response([[-1.015982, -0.332822, 0.718194], [0.157652, 0.998465], [-1.523972, 0.998465], []],
                           mask=mask)
    assert_close(advantages, expected)


def test_reinforce_plus_plus_discounts_future_rewards_within_the_response():
    rewards = on_response([[0.0, -0.5, 2.0], [1.0, 1.0], [-1.0], []], fill=7.0)
    advantages, returns = reinforce_plus_plus_advantages(rewards, RESPONSE_MASK, gamma=0.5)
    # Row 0: G4 = 2; G3 = -0.5 + 0.5 * 2 = 0.5; G2 = 0 + 0.5 * 0.5 = 0.25.  Row 1: G2 = 1; G1 = 1 + 0.5 = 1.5
    # Row 2: G3 = -1.  The prompt and padding rewards of 7 never enter.
    assert_close(returns, on_response([[0.25, 0.5, 2.0], [1.5, 1.0], [-1.0], []]))
    # Whitening 0.25, 0.5, 2, 1.5, 1, -1, in 12ths: 3, 6, 24, 18, 12, -12; mean 8.5
    #   deviations -5.5, -2.5, 15.5, 9.5, 3.5, -20.5; squares sum 799.5 -> var 159.9, std 12.645157
    expected = on_response([[-0.434949, -0.197704, 1.225766], [0.751276, 0.276786], [-1.621174], []])
    assert_close(advantages, expected)


def test_reinforce_plus_plus_baseline_centers_by_group_then_whitens_tokens():
    advantages = reinforce_plus_plus_baseline_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), RESPONSE_MASK)
    # Group 0: 1, 0 -> +0.5, -0.5; group 1: 0, 1 -> -0.5, +0.5 (row 3 has no tokens)
    # Tokens: +0.5 x3, -0.5 x2, -0.5 x1 -> mean 0, unbiased var 6 * 0.25 / 5 = 0.3, 0.5 / sqrt(0.3) = 0.912871
    a = 0.912871
    assert_close(advantages, on_response([[a, a, a], [-a, -a], [-a], []]))


# Token rewards whose response sums (the outcome estimators' scores) are 1, 0, 2 and 0 (empty row),
# spread over several tokens like an in-reward KL penalty would; the 7s are prompt and padding garbage.
SPREAD_REWARDS = on_response([[-0.25, -0.25, 1.5], [-0.5, 0.5], [2.0], []], fill=7.0)
TWO_GROUPS = torch.tensor([0, 0, 1, 1])


def test_compute_advantages_grpo_scores_rows_by_summed_token_rewards():
    advantages, returns = compute_advantages("grpo", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS))
    # Group 0: scores 1, 0 and group 1: scores 2, 0 -> both +-1 / sqrt(2) = +-0.707107
    a = 0.707107
    assert_close(advantages, on_response([[a, a, a], [-a, -a], [a], []]))
    assert returns is None


def test_compute_advantages_grpo_without_std():
    advantages, _ = compute_advantages("grpo", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS, norm_by_std=False))
    # Group 0: 1, 0 -> +-0.5; group 1: 2, 0 -> +-1
    assert_close(advantages, on_response([[0.5, 0.5, 0.5], [-0.5, -0.5], [1.0], []]))


def test_compute_advantages_rloo():
    advantages, returns = compute_advantages("rloo", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS))
    # Group 0: 1 - 0 = 1, 0 - 1 = -1; group 1: 2 - 0 = 2
    assert_close(advantages, on_response([[1.0, 1.0, 1.0], [-1.0, -1.0], [2.0], []]))
    assert returns is None


def test_compute_advantages_reinforce_plus_plus_baseline():
    advantages, returns = compute_advantages(
        "reinforce_plus_plus_baseline", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS))
    # Centered: row 0 +0.5, row 1 -0.5 (group 0: 1, 0); row 2 +1 (group 1: 2, 0)
    # Tokens: 0.5 x3, -0.5 x2, 1 x1 -> mean 0.25; deviations 0.25 x3, -0.75 x2, 0.75
    #   var = (3 * 0.0625 + 3 * 0.5625) / 5 = 0.375 -> 0.25 / 0.612372 = 0.408248, 0.75 / 0.612372 = 1.224745
    assert_close(advantages, on_response([[0.408248] * 3, [-1.224745] * 2, [1.224745], []]))
    assert returns is None


def test_compute_advantages_routes_token_level_estimators():
    values = on_response([[1.0, 0.5, 0.25], [0.5, 1.0], [2.0], []], fill=9.0)
    gae = compute_advantages("gae", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS, values=values,
                                                     gamma=0.5, lam=0.5))
    direct_gae = gae_advantages(SPREAD_REWARDS, values, RESPONSE_MASK, gamma=0.5, lam=0.5)
    reinforce = compute_advantages("reinforce_plus_plus",
                                   AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS, gamma=0.5))
    direct_reinforce = reinforce_plus_plus_advantages(SPREAD_REWARDS, RESPONSE_MASK, gamma=0.5)
    for routed, direct in ((gae, direct_gae), (reinforce, direct_reinforce)):
        for routed_tensor, direct_tensor in zip(routed, direct):
            torch.testing.assert_close(routed_tensor, direct_tensor)


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS.names())
def test_every_estimator_is_finite_and_zero_outside_the_mask(estimator):
    values = on_response([[1.0, 0.5, 0.25], [0.5, 1.0], [2.0], []], fill=NAN)
    advantages, returns = compute_advantages(estimator, AdvantageInputs(
        SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS, values=values if needs_critic(estimator) else None))
    assert advantages.shape == RESPONSE_MASK.shape and advantages.isfinite().all()
    assert (advantages[RESPONSE_MASK == 0] == 0).all()
    assert (returns is not None) == (estimator in ("gae", "reinforce_plus_plus"))


def test_compute_advantages_rejects_unknown_estimator_and_gae_without_values():
    with pytest.raises(ValueError, match="algorithm.adv_estimator='ppo' is not a registered advantage estimator "
                                         r"\(registered: gae, grpo, .*register_adv_estimator"):
        compute_advantages("ppo", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS))
    with pytest.raises(ValueError, match="gae.*values"):
        compute_advantages("gae", AdvantageInputs(SPREAD_REWARDS, RESPONSE_MASK, TWO_GROUPS))


# --- loss aggregation ----------------------------------------------------------------------------------------------

# Response sums 6, 10, 8 (and an empty row); row means 2, 5, 8; 6 tokens, 4 sequences.
PER_TOKEN = on_response([[1.0, 2.0, 3.0], [4.0, 6.0], [8.0], []], fill=NAN)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 24 / 6),  # 4.0
    ("seq-mean-token-sum", 24 / 4),  # 6.0
    ("seq-mean-token-mean", (2 + 5 + 8 + 0) / 4),  # 3.75: the empty row counts as a sequence with mean 0
    ("seq-mean-token-sum-norm", 24 / (4 * 5)),  # 1.2: sequences * horizon
])
def test_aggregate_loss_modes(mode, expected):
    assert aggregate_loss(PER_TOKEN, RESPONSE_MASK, mode, TOKEN_MEAN_OF_6).item() == pytest.approx(expected)


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'.*token-mean"):
        aggregate_loss(PER_TOKEN, RESPONSE_MASK, "mean", TOKEN_MEAN_OF_6)


# --- policy loss ---------------------------------------------------------------------------------------------------

def log_probs_for_ratios(old_log_probs: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    return old_log_probs + torch.tensor(ratios).log()


def token_mean_scale(tokens: int) -> LossScale:
    return LossScale(tokens=tokens, sequences=1, horizon=1)


def ppo_loss(log_probs, old, advantages, mask, low=0.2, high=0.2, **options):
    options.setdefault("agg_mode", "token-mean")
    options.setdefault("scale", token_mean_scale(int(torch.as_tensor(mask).sum())))
    return policy_loss(log_probs, old, advantages, mask, clip_ratio_low=low, clip_ratio_high=high, **options)


def test_policy_loss_inside_and_outside_clip_for_both_advantage_signs():
    old = torch.full((2, 3), -1.0)
    log_probs = log_probs_for_ratios(old, [[1.1, 1.5, 0.5], [1.5, 0.5, 0.9]])
    advantages = torch.tensor([1.0, -1.0])  # one per sequence, broadcast over its tokens
    loss, stats = ppo_loss(log_probs, old, advantages, torch.ones(2, 3))
    # Clip range [0.8, 1.2]; per-token loss = max(-A * r, -A * clip(r)):
    #   A=+1: r=1.1 -> max(-1.1, -1.1) = -1.1   inside
    #         r=1.5 -> max(-1.5, -1.2) = -1.2   clipped
    #         r=0.5 -> max(-0.5, -0.8) = -0.5   unclipped (pessimistic side)
    #   A=-1: r=1.5 -> max( 1.5,  1.2) =  1.5   unclipped (pessimistic side)
    #         r=0.5 -> max( 0.5,  0.8) =  0.8   clipped
    #         r=0.9 -> max( 0.9,  0.9) =  0.9   inside
    # sum = -2.8 + 3.2 = 0.4; loss = 0.4 / 6
    assert loss.item() == pytest.approx(0.4 / 6, abs=1e-6)
    assert stats.token_sums["pg_clipfrac"].item() == 2.0
    assert stats.token_sums["pg_clipfrac_lower"].item() == 0.0
    # sum(old - new) = -sum(log r) = -log(1.1 * 1.5 * 0.5 * 1.5 * 0.5 * 0.9) = -log(0.556875)
    assert stats.token_sums["ppo_kl"].item() == pytest.approx(-math.log(0.556875), abs=1e-5)
    assert stats.tokens.item() == 6.0


def test_policy_loss_ignores_prompt_and_padding_garbage_in_value_and_gradient():
    old = on_response([[0.0] * 3, [0.0] * 2, [0.0], []], fill=NAN)
    log_probs = (old + on_response([[1.1, 1.5, 0.5], [1.5, 0.5], [1.0], []], fill=NAN).log()).requires_grad_()
    advantages = on_response([[1.0] * 3, [-1.0] * 2, [2.0], []], fill=NAN)
    weights = on_response([[1.0] * 3, [1.0] * 2, [1.0], []], fill=NAN)
    loss, stats = ppo_loss(log_probs, old, advantages, RESPONSE_MASK, importance_weights=weights)
    # Row 0, A=+1: r=1.1 -> -1.1; r=1.5 -> -1.2 (clipped); r=0.5 -> -0.5        sum -2.8
    # Row 1, A=-1: r=1.5 -> 1.5; r=0.5 -> 0.8 (clipped)                          sum  2.3
    # Row 2, A=+2: r=1.0 -> -2.0                                                 sum -2.0
    # total -2.5 over 6 tokens
    assert loss.item() == pytest.approx(-2.5 / 6, abs=1e-6)
    assert stats.token_sums["pg_clipfrac"].item() == 2.0
    # -log(1.1 * 1.5 * 0.5 * 1.5 * 0.5 * 1.0) = -log(0.61875)
    assert stats.token_sums["ppo_kl"].item() == pytest.approx(-math.log(0.61875), abs=1e-5)
    assert stats.tokens.item() == 6.0
    loss.backward()
    # d(-A r)/d logp = -A r on unclipped tokens, 0 on clipped ones, all / 6; 0 outside the mask
    expected_grad = on_response([[-1.1 / 6, 0.0, -0.5 / 6], [1.5 / 6, 0.0], [-2.0 / 6], []])
    assert_close(log_probs.grad, expected_grad)


def test_policy_loss_asymmetric_clip_range():
    old = torch.zeros(2, 2)
    log_probs = log_probs_for_ratios(old, [[1.25, 1.5], [0.75, 1.25]])
    loss, stats = ppo_loss(log_probs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), low=0.2, high=0.28)
    # Clip range [0.8, 1.28]:
    #   A=+1: r=1.25 -> -1.25 (inside the higher upper bound); r=1.5 -> max(-1.5, -1.28) = -1.28
    #   A=-1: r=0.75 -> max(0.75, 0.8) = 0.8 (clipped);       r=1.25 -> 1.25
    # sum = -2.53 + 2.05 = -0.48; loss = -0.48 / 4 = -0.12
    assert loss.item() == pytest.approx(-0.12, abs=1e-6)
    assert stats.token_sums["pg_clipfrac"].item() == 2.0


def test_policy_loss_dual_clip_caps_negative_advantage_tokens():
    old = torch.zeros(2, 3)
    log_probs = log_probs_for_ratios(old, [[5.0, 2.0, 0.5], [5.0, 2.0, 0.5]]).requires_grad_()
    loss, stats = ppo_loss(log_probs, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 3), clip_ratio_c=3.0)
    # A=-1 (cap -A * c = 3): r=5 -> max(5, 1.2) = 5, capped to 3 (dual-clipped); r=2 -> 2; r=0.5 -> 0.8 (clipped)
    # A=+1 (no cap):         r=5 -> -1.2 (clipped); r=2 -> -1.2 (clipped); r=0.5 -> -0.5
    # sum = 5.8 - 2.9 = 2.9 over 6 tokens
    assert loss.item() == pytest.approx(2.9 / 6, abs=1e-6)
    assert stats.token_sums["pg_clipfrac"].item() == 3.0
    assert stats.token_sums["pg_clipfrac_lower"].item() == 1.0
    loss.backward()
    # Only the unclipped tokens have gradient -A r / 6: (A=-1, r=2) -> 2/6 and (A=+1, r=0.5) -> -0.5/6
    assert_close(log_probs.grad, [[0.0, 2 / 6, 0.0], [0.0, 0.0, -0.5 / 6]])


def test_policy_loss_rejects_dual_clip_constant_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        ppo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), clip_ratio_c=1.0)


def test_policy_loss_importance_weights_scale_each_token():
    old = torch.zeros(1, 2)
    log_probs = log_probs_for_ratios(old, [[1.1, 0.9]])
    loss, _ = ppo_loss(log_probs, old, torch.tensor([2.0]), torch.ones(1, 2),
                       importance_weights=torch.tensor([[0.5, 2.0]]))
    # -2 * 1.1 * 0.5 = -1.1 and -2 * 0.9 * 2 = -3.6 -> -4.7 / 2 tokens
    assert loss.item() == pytest.approx(-2.35, abs=1e-6)


def test_policy_loss_with_sequence_mean_aggregation():
    old = on_response([[0.0] * 3, [0.0] * 2, [0.0], []])
    log_probs = old + on_response([[1.1, 1.5, 0.5], [1.5, 0.5], [1.0], []], fill=1.0).log()
    advantages = torch.tensor([1.0, -1.0, 2.0, 5.0])
    loss, _ = ppo_loss(log_probs, old, advantages, RESPONSE_MASK, agg_mode="seq-mean-token-mean",
                       scale=TOKEN_MEAN_OF_6)
    # Row sums as in the padding test: -2.8 over 3, 2.3 over 2, -2 over 1, empty row 0
    # (-0.933333 + 1.15 - 2 + 0) / 4 sequences = -0.445833
    assert loss.item() == pytest.approx(-0.445833, abs=1e-6)


# --- value loss ----------------------------------------------------------------------------------------------------

def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error():
    values = on_response([[1.0, 2.0, 0.0], [3.0, -1.0], [0.5], []], fill=NAN)
    old_values = on_response([[1.0, 1.0, 1.0], [2.0, 0.0], [0.5], []], fill=NAN)
    returns = on_response([[2.0, 1.0, 0.0], [4.0, 1.0], [0.5], []], fill=NAN)
    loss, stats = value_loss(values, old_values, returns, RESPONSE_MASK, cliprange_value=0.5,
                             agg_mode="token-mean", scale=TOKEN_MEAN_OF_6)
    # clip(v, old - 0.5, old + 0.5); per token 0.5 * max((v - R)^2, (v_clipped - R)^2):
    #   v=1,  old=1, R=2: v_c=1,    (1)^2 both               -> 0.5
    #   v=2,  old=1, R=1: v_c=1.5,  max(1, 0.25) = 1         -> 0.5
    #   v=0,  old=1, R=0: v_c=0.5,  max(0, 0.25) = 0.25      -> 0.125  (clipped larger)
    #   v=3,  old=2, R=4: v_c=2.5,  max(1, 2.25) = 2.25      -> 1.125  (clipped larger)
    #   v=-1, old=0, R=1: v_c=-0.5, max(4, 2.25) = 4         -> 2.0
    #   v=0.5, old=0.5, R=0.5                                -> 0
    # sum 4.25 over 6 tokens
    assert loss.item() == pytest.approx(4.25 / 6, abs=1e-6)
    assert stats.token_sums["vf_clipfrac"].item() == 2.0
    assert stats.token_sums["vpred"].item() == pytest.approx(1 + 2 + 0 + 3 - 1 + 0.5)
    assert stats.tokens.item() == 6.0


# --- invariance to micro-batching and data parallelism -------------------------------------------------------------

def random_batch(rows: int = 8, positions: int = 7):
    """Random log-probs and advantages with prompts of 0-2 tokens, responses of 0-5 and padding after."""
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(rows, positions, generator=generator)
    log_probs = old + 0.5 * torch.randn(rows, positions, generator=generator)
    advantages = torch.randn(rows, positions, generator=generator)
    weights = torch.rand(rows, positions, generator=generator) * 2
    prompt_lengths = torch.tensor([2, 0, 1, 2, 1, 0, 2, 1])
    response_lengths = torch.tensor([5, 1, 0, 4, 2, 5, 3, 6])
    position = torch.arange(positions)
    mask = ((position >= prompt_lengths[:, None]) & (position < (prompt_lengths + response_lengths)[:, None]))
    return log_probs, old, advantages, weights, mask.float()


# Two data-parallel ranks of 4 rows, each split into micro-batches of uneven sizes.
MICRO_BATCHES_PER_RANK = ((slice(0, 1), slice(1, 4)), (slice(4, 6), slice(6, 8)))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_losses_on_all_ranks_sum_to_the_mini_batch_loss(mode):
    log_probs, old, advantages, weights, mask = random_batch()
    scale = LossScale(tokens=mask.sum().item(), sequences=8, horizon=7)  # global sizes, known to every rank
    micro_batches = [rows for rank in MICRO_BATCHES_PER_RANK for rows in rank]

    full_aggregate = aggregate_loss(advantages, mask, mode, scale)
    micro_aggregates = [aggregate_loss(advantages[rows], mask[rows], mode, scale) for rows in micro_batches]
    torch.testing.assert_close(sum(micro_aggregates), full_aggregate)

    def loss_of(rows):
        return policy_loss(log_probs[rows], old[rows], advantages[rows], mask[rows], clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=3.0, agg_mode=mode, scale=scale,
                           importance_weights=weights[rows])

    full_loss, full_stats = loss_of(slice(None))
    micro_losses, micro_stats = zip(*(loss_of(rows) for rows in micro_batches))
    torch.testing.assert_close(sum(micro_losses), full_loss)
    torch.testing.assert_close(sum(stats.tokens for stats in micro_stats), full_stats.tokens)
    for key, full_value in full_stats.token_sums.items():
        torch.testing.assert_close(sum(stats.token_sums[key] for stats in micro_stats), full_value)


# --- KL ------------------------------------------------------------------------------------------------------------

# log p - log ref = 0.5, -1, 0
KL_LOG_PROBS = torch.tensor([-1.0, -2.0, -0.5])
KL_REF_LOG_PROBS = torch.tensor([-1.5, -1.0, -0.5])


@pytest.mark.parametrize("estimator, expected", [
    ("k1", [0.5, -1.0, 0.0]),
    ("abs", [0.5, 1.0, 0.0]),
    ("k2", [0.125, 0.5, 0.0]),  # 0.5 * 0.25, 0.5 * 1
    ("mse", [0.125, 0.5, 0.0]),
    # x = ref - logp = -0.5, 1, 0: exp(-0.5) + 0.5 - 1 = 0.106531; e - 1 - 1 = 0.718282; 1 - 0 - 1 = 0
    ("k3", [0.106531, 0.718282, 0.0]),
    ("low_var_kl", [0.106531, 0.718282, 0.0]),
])
def test_kl_estimators(estimator, expected):
    assert_close(kl_divergence(KL_LOG_PROBS, KL_REF_LOG_PROBS, estimator), expected)


def test_every_kl_estimator_is_known():
    for estimator in KL_ESTIMATORS:
        kl_divergence(KL_LOG_PROBS, KL_REF_LOG_PROBS, estimator)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*low_var_kl"):
        kl_divergence(KL_LOG_PROBS, KL_REF_LOG_PROBS, "k4")


def test_k3_is_clamped_with_finite_gradients():
    log_probs = torch.tensor([-100.0, 0.0]).requires_grad_()
    kl = kl_divergence(log_probs, torch.tensor([0.0, -100.0]), "k3")
    # x = 100: exp(100) - 101 overflows -> 10; x = -100: exp(-100) + 100 - 1 = 99 -> 10
    assert kl.tolist() == [10.0, 10.0]
    kl.sum().backward()
    assert log_probs.grad.tolist() == [0.0, 0.0]


def test_apply_kl_penalty_subtracts_coef_times_kl_on_response_tokens():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    ref = torch.zeros(2, 3)
    log_probs = torch.tensor([[5.0, 0.2, 0.4], [5.0, -0.3, 5.0]])  # the 5s sit on prompt and padding
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    penalised, mean_kl = apply_kl_penalty(rewards, log_probs, ref, mask, coef=0.5, estimator="k1")
    # k1 = 0.2, 0.4 | -0.3 -> rewards - 0.5 * k1: 0 - 0.1, 1 - 0.2 | 2 + 0.15; mean (0.2 + 0.4 - 0.3) / 3 = 0.1
    assert_close(penalised, [[0.0, -0.1, 0.8], [0.0, 2.15, 0.0]])
    assert mean_kl == pytest.approx(0.1)


def test_fixed_kl_controller_never_changes():
    controller = kl_controller("fixed", 0.1, target_kl=0.01, horizon=100)
    assert isinstance(controller, FixedKLController)
    controller.update(current_kl=5.0, n_steps=64)
    assert controller.value == 0.1


def test_adaptive_kl_controller_moves_proportionally_with_clipped_error():
    controller = kl_controller("adaptive", 0.2, target_kl=0.1, horizon=100)
    assert isinstance(controller, AdaptiveKLController)
    controller.update(current_kl=0.11, n_steps=10)  # error 0.1 -> 0.2 * (1 + 0.1 * 10 / 100) = 0.202
    assert controller.value == pytest.approx(0.202)
    controller.update(current_kl=1.0, n_steps=10)  # error 9 clipped to 0.2 -> 0.202 * 1.02 = 0.20604
    assert controller.value == pytest.approx(0.20604)
    controller.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2 -> 0.20604 * 0.9 = 0.185436
    assert controller.value == pytest.approx(0.185436)


def test_kl_controller_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        kl_controller("pid", 0.1, target_kl=0.1, horizon=100)


# --- rollout / train mismatch --------------------------------------------------------------------------------------

def test_rollout_mismatch_metrics_over_response_tokens():
    train = on_response([[0.1, -0.2, 0.0], [0.3, -0.1], [0.1], []], fill=50.0)
    rollout = torch.zeros(4, 5)
    metrics = rollout_mismatch_metrics(train, rollout, RESPONSE_MASK)
    # |diff| = 0.1, 0.2, 0, 0.3, 0.1, 0.1 -> mean 0.8 / 6 = 0.133333, exp(0.133333) = 1.142631, max 0.3
    assert metrics["mismatch/mean_abs_logprob_diff"] == pytest.approx(0.133333, abs=1e-6)
    assert metrics["mismatch/token_mult_prob_error"] == pytest.approx(1.142631, abs=1e-6)
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(0.3, abs=1e-6)


def test_loss_stats_add_up_over_micro_batches():
    totals = LossStats(tokens=0.0, token_sums={})
    totals.add(LossStats(torch.tensor(3.0), {"pg_clipfrac": torch.tensor(1.0)}, {"pg_loss": torch.tensor(0.5)}))
    totals.add(LossStats(torch.tensor(2.0), {"pg_clipfrac": torch.tensor(2.0)}, {"pg_loss": torch.tensor(-0.25)}))
    assert (totals.tokens, totals.token_sums, totals.losses) == (5.0, {"pg_clipfrac": 3.0}, {"pg_loss": 0.25})
