"""Configuration: YAML + `key=value` overrides onto the typed schema, validated before anything starts."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_megatron.config.schema import Config


class ConfigError(ValueError):
    """A configuration problem, worded for the user: what is wrong, where, and how to fix it."""


def _schema_keys(cls, prefix: str = "") -> dict[str, Any]:
    """Every dotted key the schema declares, mapped to its field type (dataclass for sections)."""
    keys = {}
    for f in dataclasses.fields(cls):
        dotted = prefix + f.name
        keys[dotted] = f.type
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.update(_schema_keys(type(default), dotted + "."))
    return keys


_KEYS = _schema_keys(Config)


def _reject_unknown(tree: dict, where: str, prefix: str = "") -> None:
    for key, value in tree.items():
        dotted = prefix + str(key)
        if dotted not in _KEYS:
            close = difflib.get_close_matches(dotted, list(_KEYS), n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else " See rl_megatron/config/schema.py for the keys."
            raise ConfigError(f"Unknown config key '{dotted}' in {where}.{hint}")
        if isinstance(value, dict) and not isinstance(value, list):
            _reject_unknown(value, where, dotted + ".")


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Merge `path` (YAML) and `overrides` (`a.b=value`) onto the schema and validate the result."""
    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"Config file '{path}' does not exist. Pass an existing YAML, e.g. configs/demo_cpu.yaml.")
        try:
            tree = OmegaConf.to_container(OmegaConf.load(path))
        except Exception as err:  # yaml.YAMLError and friends: report them all the same way
            raise ConfigError(f"Config file '{path}' is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"Config file '{path}' must hold a mapping of sections (trainer:, model:, ...).")
        _reject_unknown(tree, f"'{path}'")
        layers.append(tree)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override '{item}' is not of the form key=value (e.g. trainer.total_steps=5).")
        key, value = item.split("=", 1)
        if key not in _KEYS:
            _reject_unknown({key: None}, "the command-line overrides")
        layers.append(OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"])))
    merged = OmegaConf.structured(Config)
    try:
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"Config key '{missing[0]}' must be set (in the YAML or as {missing[0]}=...).")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"Config key '{key}' has a bad value: {err.msg if hasattr(err, 'msg') else err}") from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def read_hf_config(model_path: str) -> dict:
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"model.path='{model_path}' has no config.json. Point model.path at a Hugging Face model folder "
            "(config.json, tokenizer files, *.safetensors).")
    with open(config_file) as f:
        return json.load(f)


def validate(cfg: Config) -> None:
    """Check everything that can be checked before a process starts; raise ConfigError on the first problem."""
    t, a, r, d = cfg.trainer, cfg.actor, cfg.rollout, cfg.data
    _positive(("trainer.total_steps", t.total_steps), ("trainer.nnodes", t.nnodes),
              ("trainer.n_gpus_per_node", t.n_gpus_per_node),
              ("actor.tensor_model_parallel_size", a.tensor_model_parallel_size),
              ("actor.pipeline_model_parallel_size", a.pipeline_model_parallel_size),
              ("actor.context_parallel_size", a.context_parallel_size),
              ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size), ("actor.ppo_epochs", a.ppo_epochs),
              ("actor.micro_batch_size", a.micro_batch_size), ("rollout.n", r.n),
              ("rollout.max_tokens", r.max_tokens), ("rollout.tensor_parallel_size", r.tensor_parallel_size),
              ("data.train_batch_size", d.train_batch_size), ("data.max_prompt_length", d.max_prompt_length))
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype='{cfg.model.dtype}' is not supported: use float32 or bfloat16.")
    if a.optim.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ConfigError(f"actor.optim.lr_decay_style='{a.optim.lr_decay_style}': use constant, linear or cosine.")
    if cfg.algorithm.adv_estimator != "grpo":
        raise ConfigError(f"algorithm.adv_estimator='{cfg.algorithm.adv_estimator}' is unknown: use grpo.")
    if cfg.algorithm.loss_agg_mode != "token-mean":
        raise ConfigError(f"algorithm.loss_agg_mode='{cfg.algorithm.loss_agg_mode}' is unknown: use token-mean.")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 (RL needs sampling; use 1.0).")

    world = t.nnodes * t.n_gpus_per_node
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    if cp != 1:
        raise ConfigError(f"actor.context_parallel_size={cp}: only 1 is supported yet.")
    if world % (tp * pp * cp):
        raise ConfigError(
            f"The actor has {world} devices (trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node="
            f"{t.n_gpus_per_node}), which TP x PP x CP = {tp} x {pp} x {cp} does not divide. "
            "Choose sizes whose product divides the device count; the rest becomes data parallelism.")
    dp = world // (tp * pp * cp)
    if world % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} does not divide the actor's "
                          f"{world} devices.")
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} is not a multiple of "
                          f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}.")
    samples = a.ppo_mini_batch_size * r.n
    if samples % (dp * a.micro_batch_size):
        raise ConfigError(
            f"A mini-batch holds actor.ppo_mini_batch_size x rollout.n = {samples} samples, which is not a multiple "
            f"of data-parallel size {dp} x actor.micro_batch_size={a.micro_batch_size}. Change one of them.")
    if (d.train_batch_size * r.n) % (world // r.tensor_parallel_size):
        raise ConfigError(
            f"data.train_batch_size x rollout.n = {d.train_batch_size * r.n} samples do not split evenly over "
            f"{world // r.tensor_parallel_size} rollout engines.")
    if d.max_prompt_length + r.max_tokens > r.max_model_len:
        raise ConfigError(f"data.max_prompt_length + rollout.max_tokens = {d.max_prompt_length + r.max_tokens} "
                          f"exceeds rollout.max_model_len={r.max_model_len}; raise max_model_len.")

    hf = read_hf_config(cfg.model.path)
    _validate_model(hf, tp, pp, r.tensor_parallel_size)


def _validate_model(hf: dict, tp: int, pp: int, rollout_tp: int) -> None:
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if key not in hf:
            raise ConfigError(f"The model's config.json lacks '{key}'; is it a decoder-only causal LM?")
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    for name, size in (("actor.tensor_model_parallel_size", tp), ("rollout.tensor_parallel_size", rollout_tp)):
        if heads % size or groups % size:
            raise ConfigError(
                f"{name}={size} must divide the model's attention heads ({heads}) and key/value heads ({groups}).")
    if hf["num_hidden_layers"] % pp:
        raise ConfigError(f"actor.pipeline_model_parallel_size={pp} must divide the model's "
                          f"{hf['num_hidden_layers']} layers.")


def _positive(*pairs) -> None:
    for key, value in pairs:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")
