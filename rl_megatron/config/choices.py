"""The fixed choices of the schema's `Literal` keys, here so that the schema needs no feature package: each package
that acts on a choice imports its names from this module (tests/unit/test_config_choices.py holds the packages'
own tables to them).

The names a user extends at run time (actor.policy_loss, algorithm.adv_estimator, the reward scorers) are not
listed here: they are plain strings in the schema, checked against their live registries once trainer.imports has
run (`rl_megatron.preflight.resolve`).
"""
from __future__ import annotations

# trainer.logger: console (the terminal) and the record-keeping backends of `rl_megatron.tracking`
LOGGERS = ("console", "tensorboard", "jsonl", "wandb", "mlflow")
DEFAULT_LOGGERS = ("console", "tensorboard", "jsonl")

# actor.kl_loss_type, algorithm.kl_penalty: `rl_megatron.algorithms.kl.kl_divergence`'s estimators
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "mse", "low_var_kl")

# actor.loss_agg_mode, critic.loss_agg_mode: `rl_megatron.algorithms.losses.aggregate_loss`'s modes
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# trainer.async_mode: where each step's samples come from (`rl_megatron.trainer.rollout_ahead`, `.streaming`)
SYNC, ONE_STEP_OFF, STREAMING = "sync", "one_step_off", "streaming"
ASYNC_MODES = (SYNC, ONE_STEP_OFF, STREAMING)

# rollout.agent_loop's built-in single-turn value: each prompt answered in one batched generation (no agent loop)
SINGLE_TURN = "single_turn"

# rollout.multi_turn.format: how the model writes tool calls and reads their replies: hermes (`rl_megatron.tools.calls`,
# Qwen's <tool_call> blocks), harmony (`rl_megatron.tools.harmony`, gpt-oss), or auto (from the chat template)
AUTO_FORMAT, HERMES, HARMONY = "auto", "hermes", "harmony"
TOOL_FORMATS = (AUTO_FORMAT, HERMES, HARMONY)

# resharding.channel: auto (shared memory between CPU processes on one machine, the process group (NCCL) between
# GPUs), or one of `rl_megatron.resharding.channels`' channels
CHANNELS = ("auto", "process_group", "shared_memory")

# data.task: the built-in tasks `rl_megatron.data.TASKS` generates on the fly
TASK_NAMES = ("arithmetic", "lookup")

# reward.gsm8k_match, reward.math_match: how the gsm8k and MATH scorers compare answers ("exact" gives verl's
# scores, "numeric" also accepts equal values written differently)
MATCH_MODES = ("exact", "numeric")

# actor.lora.target_modules: the Hugging Face linear modules LoRA adapts (PEFT's names): those of the decoder layers
# (all-linear: every one, as PEFT's all-linear), and the output layer (lm_head) when named
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ("all-linear", *LORA_MODULES, "lm_head")


def lora_modules(target_modules: list[str]) -> tuple[str, ...]:
    """The HF modules actor.lora.target_modules names, in LORA_TARGETS' order."""
    layers = LORA_MODULES if "all-linear" in target_modules else tuple(m for m in LORA_MODULES if m in target_modules)
    return layers + (("lm_head",) if "lm_head" in target_modules else ())
