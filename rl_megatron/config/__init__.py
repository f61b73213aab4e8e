"""Configuration: YAML + `key=value` overrides onto the typed schema (`load`), derived values filled in
(`resolve`), and everything checked before anything starts (`preflight`). `load_config` does all three.

  schema.py       the keys, their defaults, ranges (`checked`) and choices (`Literal`)
  fields.py       the one check of every key's range and choices
  load.py         YAML and overrides -> Config
  resolve.py      derived values (rollout.max_model_len, critic and reference sizes, critic.enable, data files)
  preflight.py    the checks of keys together, and each package's own (data, rewards, models)
  layout.py       parallel layouts against devices, batches and the model
  model_files.py  model.path's config.json with the moe section's overrides
  pools.py        the worker pools the launcher plans and the trainer starts
"""
from __future__ import annotations

from typing import Sequence

from rl_megatron.config.schema import Config
from rl_megatron.config.load import load, to_dict, to_yaml
from rl_megatron.config.model_files import model_config, moe_hf_overrides, read_hf_config
from rl_megatron.config.pools import WorkerPool, uses_reference, worker_pools
from rl_megatron.config.preflight import preflight
from rl_megatron.config.resolve import resolve
from rl_megatron.errors import ConfigError, one_line
from rl_megatron.models.checks import check_model_layout

__all__ = ["Config", "ConfigError", "WorkerPool", "check_model_layout", "load", "load_config", "model_config",
           "moe_hf_overrides", "one_line", "preflight", "read_hf_config", "resolve", "to_dict", "to_yaml",
           "uses_reference", "worker_pools"]


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """The config `path` (YAML) and `overrides` (`a.b=value`) describe, its derived values filled in and checked
    before anything starts (ConfigError naming the key and the fix)."""
    cfg = resolve(load(path, overrides))
    preflight(cfg)
    return cfg
