"""The values a config leaves to be worked out from others, filled in: what every process then reads."""
from __future__ import annotations

import copy

from rl_megatron.algorithms import ADV_ESTIMATORS, POLICY_LOSSES, needs_critic
from rl_megatron.config.choices import ONE_STEP_OFF, SINGLE_TURN, STREAMING, SYNC
from rl_megatron.config.extensions import resolve_extension_keys
from rl_megatron.config.fields import check_fields
from rl_megatron.config.schema import RULES, Config
from rl_megatron.data.section import resolve_data_section
from rl_megatron.errors import ConfigError
from rl_megatron.plugins import import_user_modules
from rl_megatron.rollout.engine import ENGINES

# The registries whose entries may own config keys: those the schema's `extension_name` keys name.
EXTENSIBLE = (POLICY_LOSSES, ADV_ESTIMATORS)


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` with its derived values: rollout.max_model_len (the longest prompt + response),
    rollout.gpu_memory_utilization (by placement), data.gen_batch_size, critic.enable (when the advantage estimator needs values), the
    reference's, teacher's, reward model's and critic's unset sizes (the actor's; a colocated role runs in the actor's processes), the critic's
    model folder, the rollout correction's shorthand (algorithm.rollout_is_cap), the data section's file lists and built-in task (`rl_megatron.data.section`), and the registered extensions' own keys (checked, with their defaults). `cfg`'s values are checked against their rules in
    schema.py first (ConfigError naming the key), so that what is derived from them is sound."""
    check_fields(cfg, RULES)
    # The names a registry resolves (a user's own come from trainer.imports), and what they imply (the critic).
    import_user_modules(cfg.trainer.imports)
    ADV_ESTIMATORS.check(cfg.algorithm.adv_estimator)
    POLICY_LOSSES.check(cfg.actor.policy_loss)
    ENGINES.check(cfg.rollout.engine)
    cfg = copy.deepcopy(cfg)
    cfg.extension_keys = resolve_extension_keys(cfg.extension_keys, EXTENSIBLE)
    actor, rollout, critic = cfg.actor, cfg.rollout, cfg.critic
    turns = rollout.multi_turn
    if turns.max_response_length is None:
        turns.max_response_length = turns.max_assistant_turns * (rollout.max_tokens + turns.max_tool_response_length)
    if rollout.max_model_len is None:
        single_turn = rollout.agent_loop == SINGLE_TURN and rollout.agent.function is None
        response = rollout.max_tokens if single_turn else turns.max_response_length
        rollout.max_model_len = cfg.data.max_prompt_length + response
    if rollout.gpu_memory_utilization is None:  # separate engines hold nothing else on their GPUs
        rollout.gpu_memory_utilization = 0.9 if rollout.placement == "separate" else 0.5
    if critic.enable is None:
        critic.enable = needs_critic(cfg.algorithm.adv_estimator)
    for role in (cfg.ref, cfg.teacher, cfg.reward_model, critic):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                    "max_tokens_per_micro_batch"):
            if getattr(role, key) is None:
                setattr(role, key, getattr(actor, key))
    # The three recompute keys are one setting: the critic's own when it sets any of them, else all the actor's (key
    # by key, an actor's full/uniform would leave its method on a critic that asks for selective).
    recompute_keys = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    if all(getattr(critic, key) is None for key in recompute_keys):
        for key in recompute_keys:
            setattr(critic, key, getattr(actor, key))
    critic.model_path = critic.model_path or cfg.model.path
    # 0 (as well as unset) means the actor's: the critic trains on the actor's mini-batches unless told otherwise.
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    _resolve_async_mode(cfg)
    correction = cfg.algorithm.rollout_correction
    if cfg.algorithm.rollout_is_cap is not None:  # the shorthand for token-level truncation
        if correction.level is not None:
            raise ConfigError(f"algorithm.rollout_is_cap={cfg.algorithm.rollout_is_cap} and "
                              f"algorithm.rollout_correction.level={correction.level} both set the rollout correction; "
                              "keep one (rollout_is_cap=C means level=token, mode=truncate, threshold=C).")
        correction.level, correction.mode, correction.threshold = "token", "truncate", cfg.algorithm.rollout_is_cap
    if correction.bypass_mode is None:  # stale samples learn best clipped against the policy that sampled them
        correction.bypass_mode = cfg.trainer.rollout_staleness > 0 and correction.level is None
    elif correction.bypass_mode and correction.level is not None:
        raise ConfigError(f"algorithm.rollout_correction.bypass_mode=true and algorithm.rollout_correction.level="
                          f"{correction.level} both correct for the rollout's policy: bypass mode takes the PPO ratio "
                          "against the rollout's log-probs, which leaves the weights p_train / p_rollout nothing to "
                          "correct. Keep one (docs/async.md).")
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size
    cfg.data = resolve_data_section(cfg.data)
    return cfg


def _resolve_async_mode(cfg: Config) -> None:
    """trainer.async_mode from trainer.rollout_staleness when unset; an asynchronous mode's staleness at least 1;
    streaming continues requests across weight updates (rollout.partial_rollout)."""
    trainer = cfg.trainer
    if trainer.async_mode is None:
        trainer.async_mode = ONE_STEP_OFF if trainer.rollout_staleness else SYNC
    elif trainer.async_mode == SYNC and trainer.rollout_staleness:
        raise ConfigError(f"trainer.async_mode=sync trains every batch on the weights that sampled it, but "
                          f"trainer.rollout_staleness={trainer.rollout_staleness} lets the rollout lag: set "
                          "trainer.rollout_staleness=0, or trainer.async_mode=one_step_off or streaming.")
    elif trainer.async_mode != SYNC and not trainer.rollout_staleness:
        trainer.rollout_staleness = 1
    if trainer.async_mode == STREAMING:
        cfg.rollout.partial_rollout = True
