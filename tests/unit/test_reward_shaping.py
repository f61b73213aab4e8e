"""DAPO's overlong reward shaping: the penalty against hand-computed values, and its config keys
(reward.overlong_buffer) with their ranges and the pre-flight check against rollout.max_tokens."""
import os

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.algorithms import overlong_penalty
from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.config.fields import NOT_NEGATIVE, POSITIVE, check_fields
from rl_megatron.config.schema import RULES, Config

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")


def demo_config(*overrides) -> Config:
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


@pytest.mark.parametrize("tokens, expected", [
    (0, 0.0),
    (10, 0.0),  # below the buffer
    (16, 0.0),  # at max_tokens - buffer_len: the buffer starts, no penalty yet
    (17, -0.125),  # 1 of 8 buffer tokens used: -1/8 * factor
    (20, -0.5),  # midway: -factor / 2
    (24, -1.0),  # at max_tokens: -factor
    (30, -1.0),  # beyond (a multi-turn trajectory's tokens over all turns): clamped at -factor
])
def test_overlong_penalty_at_the_boundaries(tokens, expected):
    penalty = overlong_penalty(torch.tensor([tokens]), max_tokens=24, buffer_len=8, penalty_factor=1.0)
    assert penalty.tolist() == [expected]


def test_overlong_penalty_of_a_batch_scales_with_the_factor():
    lengths = torch.tensor([100, 4096, 5120, 6144, 8192, 20000])
    penalty = overlong_penalty(lengths, max_tokens=8192, buffer_len=4096, penalty_factor=0.5)
    assert penalty.dtype == torch.float32
    assert penalty.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, 8192, 4096, 0.0).tolist() == [0.0] * 6  # factor 0: no penalty


def test_the_overlong_buffer_keys_and_their_ranges():
    buffer = Config().reward.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (False, 4096, 1.0)  # DAPO's buffer and factor
    assert RULES["reward.overlong_buffer.len"].bound == POSITIVE
    assert RULES["reward.overlong_buffer.penalty_factor"].bound == NOT_NEGATIVE
    cfg = Config()
    cfg.reward.overlong_buffer.penalty_factor = -1.0
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.penalty_factor=-1.0 must not be negative"):
        check_fields(cfg, RULES)


@pytest.mark.parametrize("buffer_len", [1, 4])  # as long as the demo's rollout.max_tokens=1, and longer
def test_a_buffer_as_long_as_the_response_is_refused_naming_both_keys(buffer_len):
    with pytest.raises(ConfigError) as info:
        demo_config("reward.overlong_buffer.enable=true", f"reward.overlong_buffer.len={buffer_len}")
    message = str(info.value)
    assert f"reward.overlong_buffer.len={buffer_len} must be below rollout.max_tokens=1" in message
    assert "reward.overlong_buffer.enable=false" in message  # the fixes are named


def test_a_buffer_below_the_response_limit_or_switched_off_passes():
    assert demo_config("reward.overlong_buffer.len=4").reward.overlong_buffer.len == 4  # off: not checked
    cfg = demo_config("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=1", "rollout.max_tokens=2")
    assert cfg.reward.overlong_buffer.enable and cfg.rollout.max_tokens == 2
