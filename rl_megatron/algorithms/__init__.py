"""RL algorithm math (advantages, policy losses), free of any distributed or model code."""
from rl_megatron.algorithms.core import grpo_advantages, masked_mean, masked_sum, ppo_clip_policy_loss

__all__ = ["grpo_advantages", "masked_mean", "masked_sum", "ppo_clip_policy_loss"]
