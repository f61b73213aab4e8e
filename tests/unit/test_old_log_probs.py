"""Where a step's old log-probs come from (`trainer/old_log_probs.py`): the update's own forward pass exactly where
a batch trains on-policy in one optimizer step and nothing needs them before the update or differently; a pass of
their own in every other case. (That both give the same update: tests/distributed/test_ppo_invariance.py.)"""
import json
import os

import pytest
from helpers.runs import REPO

from rl_megatron.config.schema import Config
from rl_megatron.trainer.old_log_probs import old_log_probs_from_update


def hf_config(name: str) -> dict:
    with open(os.path.join(REPO, "configs", "models", name, "config.json")) as f:
        return json.load(f)


DENSE, MOE = hf_config("tiny-qwen2-digits"), hf_config("tiny-qwen3-moe-digits")


def on_policy() -> Config:
    """One PPO epoch of one mini-batch: 16 prompts a step, 16 per optimizer step (the schema's defaults)."""
    cfg = Config()
    cfg.actor.ppo_epochs, cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size = 1, 16, 16
    return cfg


def test_one_epoch_of_one_mini_batch_takes_them_from_the_update():
    assert old_log_probs_from_update(on_policy(), DENSE)
    # What the update reads beside them changes nothing: its own forward gives the correction's weights, the KL loss
    # compares with the reference, the entropy bonus is in the same forward, the critic trains apart.
    cfg = on_policy()
    cfg.algorithm.rollout_correction.level, cfg.algorithm.rollout_correction.mode = "sequence", "mask"
    cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = True, 0.01
    cfg.algorithm.adv_estimator, cfg.critic.warmup_steps = "gae", 3
    cfg.trainer.rollout_staleness = 1
    assert old_log_probs_from_update(cfg, DENSE)
    # LoRA without dropout: the update's forward is the pass's.
    cfg.actor.lora.rank = 8
    assert old_log_probs_from_update(cfg, DENSE)


@pytest.mark.parametrize("case", ["epochs", "mini_batches"])
def test_an_optimizer_step_before_some_tokens_train_keeps_the_pass(case):
    cfg = on_policy()
    if case == "epochs":
        cfg.actor.ppo_epochs = 2
    else:
        cfg.data.train_batch_size = 32  # two mini-batches of 16 prompts (the demo's)
    assert not old_log_probs_from_update(cfg, DENSE)


def test_the_kl_penalty_in_the_reward_keeps_the_pass():
    cfg = on_policy()
    cfg.algorithm.use_kl_in_reward = True  # it reads them before the advantages
    assert not old_log_probs_from_update(cfg, DENSE)


@pytest.mark.parametrize("replay", ["R2", "R3", "disabled"])
def test_moe_routing_carried_by_the_actors_passes_keeps_the_pass(replay):
    cfg = on_policy()
    cfg.actor.router_replay = replay  # disabled: the engines' routing alone (moe/routing_agreement, in the pass)
    assert not old_log_probs_from_update(cfg, MOE)
    if replay == "disabled":  # without the engines' routing an MoE policy is as a dense one
        cfg.moe.engine_routing = False
        assert old_log_probs_from_update(cfg, MOE)


def test_lora_dropout_keeps_the_pass():
    cfg = on_policy()
    cfg.actor.lora.rank, cfg.actor.lora.dropout = 8, 0.05  # only the update's forward drops
    assert not old_log_probs_from_update(cfg, DENSE)


def test_bypass_mode_keeps_the_pass():
    cfg = on_policy()
    cfg.algorithm.rollout_correction.bypass_mode = True  # the ratio is against the rollout's log-probs
    assert not old_log_probs_from_update(cfg, DENSE)
