"""Rollout-correction weights (TIS / MIS, per token or per sequence) against hand-worked values.

MASK: a prompt token before each response; row 0 has 3 response tokens, row 1 has 2 and a padding position, row 2 an
empty response. The log-probs' differences on the responses are chosen so that the ratios p_train / p_rollout are
    row 0: 0.5, 1, 3         (product 1.5)
    row 1: e^2, 1.5          (product 1.5 e^2 = 11.08)
and positions outside the mask hold NaN, which must not reach the weights or the metrics.
"""
import math

import pytest
import torch

from rl_megatron.algorithms import rollout_correction_metrics, rollout_correction_weights

NAN = float("nan")
MASK = torch.tensor([
    [0, 1, 1, 1],
    [0, 1, 1, 0],
    [0, 0, 0, 0],
])
ROLLOUT = torch.tensor([
    [NAN, -1.0, -2.0, -0.5],
    [NAN, -3.0, -1.0, NAN],
    [NAN, NAN, NAN, NAN],
])
LOG_RATIOS = torch.tensor([
    [0.0, math.log(0.5), 0.0, math.log(3.0)],
    [0.0, 2.0, math.log(1.5), 0.0],
    [0.0, 0.0, 0.0, 0.0],
])
OLD = ROLLOUT + LOG_RATIOS


def weights_of(level, mode, threshold=2.0, old=OLD, rollout=ROLLOUT, mask=MASK):
    return (rollout_correction_weights(old, rollout, mask, level, mode, threshold),
            rollout_correction_metrics(old, rollout, mask, level, mode, threshold))


def assert_close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=0)


def test_token_truncate_caps_each_token_ratio():
    weights, metrics = weights_of("token", "truncate")
    # e^2 = 7.39 and 3 capped at 2
    assert_close(weights, [[0, 0.5, 1.0, 2.0], [0, 2.0, 1.5, 0], [0, 0, 0, 0]])
    # (0.5 + 1 + 2 + 2 + 1.5) / 5 response tokens; 2 of the 5 ratios past the threshold
    assert metrics == pytest.approx({"rollout_corr/weight_mean": 1.4, "rollout_corr/capped_fraction": 0.4})


def test_token_mask_excludes_each_token_past_the_threshold():
    weights, metrics = weights_of("token", "mask")
    assert_close(weights, [[0, 0.5, 1.0, 0], [0, 0, 1.5, 0], [0, 0, 0, 0]])
    # (0.5 + 1 + 1.5) / 5; the 3 and the e^2 tokens excluded
    assert metrics == pytest.approx({"rollout_corr/weight_mean": 0.6, "rollout_corr/masked_fraction": 0.4})


def test_sequence_truncate_caps_the_product_over_the_response():
    weights, metrics = weights_of("sequence", "truncate")
    # row 0: 0.5 * 1 * 3 = 1.5 on each of its tokens; row 1: 1.5 e^2 = 11.08 capped at 2
    assert_close(weights, [[0, 1.5, 1.5, 1.5], [0, 2.0, 2.0, 0], [0, 0, 0, 0]])
    # (3 * 1.5 + 2 * 2) / 5; row 1's 2 tokens capped
    assert metrics == pytest.approx({"rollout_corr/weight_mean": 1.7, "rollout_corr/capped_fraction": 0.4})


def test_sequence_mask_excludes_the_whole_sequence():
    weights, metrics = weights_of("sequence", "mask")
    # row 1's token ratio 1.5 is under the threshold, but its sequence's 11.08 is not: all of row 1 goes
    assert_close(weights, [[0, 1.5, 1.5, 1.5], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert metrics == pytest.approx({"rollout_corr/weight_mean": 0.9, "rollout_corr/masked_fraction": 0.4})


def test_a_ratio_equal_to_the_threshold_is_kept():
    old = ROLLOUT + torch.tensor([[0.0, math.log(2.0), 0.0, 0.0], [0.0] * 4, [0.0] * 4])
    weights, metrics = weights_of("token", "mask", old=old)
    assert_close(weights, [[0, 2.0, 1.0, 1.0], [0, 1.0, 1.0, 0], [0, 0, 0, 0]])
    assert metrics["rollout_corr/masked_fraction"] == 0.0
    weights, _ = weights_of("sequence", "mask", threshold=1.0, old=ROLLOUT.clone())
    assert_close(weights, [[0, 1.0, 1.0, 1.0], [0, 1.0, 1.0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_weights_are_detached_float_and_zero_outside_the_response(level, mode):
    old = OLD.to(torch.bfloat16).requires_grad_()
    weights, _ = weights_of(level, mode, old=old, rollout=ROLLOUT.to(torch.bfloat16))
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert torch.isfinite(weights).all() and (weights[MASK == 0] == 0).all()


def test_a_long_sequence_with_a_large_log_ratio_sum_does_not_overflow():
    # 1000 tokens each with log ratio +1 (sum 1000: exp overflows float32 past 88), one with -1 (sum -1000)
    mask = torch.ones(2, 1000)
    rollout = torch.full((2, 1000), -5.0)
    old = rollout + torch.tensor([[1.0], [-1.0]])
    weights, metrics = weights_of("sequence", "truncate", old=old, rollout=rollout, mask=mask)
    assert_close(weights[:, :2], [[2.0, 2.0], [0.0, 0.0]])
    assert torch.isfinite(weights).all() and metrics["rollout_corr/weight_mean"] == pytest.approx(1.0)
    weights, metrics = weights_of("sequence", "mask", old=old, rollout=rollout, mask=mask)
    assert torch.isfinite(weights).all() and (weights == 0).all()
    assert metrics == {"rollout_corr/weight_mean": 0.0, "rollout_corr/masked_fraction": 0.5}


def test_unknown_level_or_mode_is_refused():
    with pytest.raises(ValueError, match="level='tokens'"):
        weights_of("tokens", "truncate")
    with pytest.raises(ValueError, match="mode='clip'"):
        weights_of("token", "clip")
