"""The model a config names: model.path's config.json, with the moe section's overrides applied (each family's
keys: `models.family`), each role's model (the critic's trunk, the teacher's, the reward model's), and the token ids its generation
stops at."""
from __future__ import annotations

import json
import os

from rl_megatron.config.schema import Config
from rl_megatron.errors import ConfigError, one_line
from rl_megatron.models.family import FAMILIES, moe_experts
from rl_megatron.roles import Role


def read_hf_config(model_path: str, key: str = "model.path") -> dict:
    """The folder's config.json; ConfigError naming `key` (the config key that names the folder) when it is not one."""
    if not os.path.isdir(model_path):
        raise ConfigError(
            f"{key}='{model_path}' is not a folder (relative paths count from {os.getcwd()}). Point {key} "
            "at a Hugging Face model folder (config.json, tokenizer files, *.safetensors).")
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"{key}='{model_path}' has no config.json. Point {key} at a Hugging Face model folder "
            "(config.json, tokenizer files, *.safetensors).")
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{key}='{model_path}': config.json is not readable JSON ({one_line(err)}). "
                          "Fix or replace the file.") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}='{model_path}': config.json must hold a JSON object, "
                          f"not a {type(hf).__name__}.")
    return hf


def moe_hf_overrides(cfg: Config, hf: dict) -> dict:
    """The config.json fields that moe.num_experts and moe.top_k replace: Megatron builds from the result, and the
    vLLM engines get the same fields as hf_overrides (so both sides route alike)."""
    family = FAMILIES.get(hf.get("model_type"))
    if family is None or family.moe is None:
        return {}
    overrides = {}
    if cfg.moe.num_experts is not None:
        # The family's own key: Qwen's num_experts, transformers >= 5's num_local_experts, DeepSeek's n_routed_experts.
        overrides[family.moe.required_fields(hf)[0]] = cfg.moe.num_experts
    if cfg.moe.top_k is not None:
        overrides["num_experts_per_tok"] = cfg.moe.top_k
    return overrides


def engine_routing(cfg: Config, hf: dict) -> bool:
    """Whether the rollout engines return each token's experts (moe.engine_routing; None: for MoE models)."""
    return bool(moe_experts(hf)) if cfg.moe.engine_routing is None else cfg.moe.engine_routing


def carries_routing(cfg: Config, hf: dict, trainable: bool) -> bool:
    """Whether a policy model's passes carry each token's experts: the actor's under routing replay or with the
    engines' routing (to measure the agreement), the frozen reference's under R3 (`models/router_replay.py`)."""
    if not trainable:
        return cfg.actor.router_replay == "R3"
    return cfg.actor.router_replay != "disabled" or engine_routing(cfg, hf)


def model_config(cfg: Config) -> dict:
    """model.path's config.json with the moe section's overrides: the model every process builds."""
    hf = read_hf_config(cfg.model.path)
    return {**hf, **moe_hf_overrides(cfg, hf)}


def role_model_config(cfg: Config, role: Role, policy_hf: dict) -> dict:
    """The config.json of the model `role` holds: the critic's trunk (critic.model_path), a model of its own (the
    teacher's, the reward model's: <role>.model.path), else the policy's (`policy_hf`: `model_config(cfg)`)."""
    if role is Role.CRITIC:
        return read_hf_config(cfg.critic.model_path, "critic.model_path")
    if role.own_model:
        return read_hf_config(getattr(cfg, role.value).model.path, f"{role}.model.path")
    return policy_hf


def end_of_sequence_ids(model_path: str, hf: dict) -> list[int]:
    """The token ids generation stops at: config.json's `eos_token_id` (`hf`) and generation_config.json's, each
    one id or a list (Llama 3.1 lists three), in that order without repeats. ConfigError naming model.path when
    there is none, or one is not a token id of the model."""
    ids = _id_list(hf.get("eos_token_id"))
    generation_file = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(generation_file):
        try:
            with open(generation_file) as f:
                ids += _id_list(json.load(f).get("eos_token_id"))
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
            raise ConfigError(f"model.path='{model_path}': generation_config.json is not a readable JSON object "
                              f"({one_line(err)}). Fix or remove the file.") from None
    ids = list(dict.fromkeys(ids))
    vocab_size = hf.get("vocab_size")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0
           or (isinstance(vocab_size, int) and i >= vocab_size)]
    if not ids or bad:
        problem = f"{bad[0]!r} is not a token id below vocab_size={vocab_size}" if bad else "none is given"
        raise ConfigError(f"model.path='{model_path}': the end-of-sequence token ids (eos_token_id in config.json "
                          f"or generation_config.json) tell generation where to stop, but {problem}. Set "
                          "eos_token_id as the model's original folder has it.")
    return ids


def _id_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]
