"""Configuration: the typed schema, and YAML + `key=value` overrides merged onto it (`load`). The floor of the
package tree: it imports nothing of rl_megatron but the leaf modules `errors`, `roles` and `registry`, so that every
package can import its types. A config is resolved and checked against the code, the model and the data before
anything starts by `rl_megatron.preflight` (`load_config` does all of it).

  schema.py      the keys, their defaults, ranges (`checked`) and choices (`Literal`)
  choices.py     the fixed choices of the schema's `Literal` keys, which the packages acting on them import
  fields.py      the one check of every key's range and choices
  load.py        YAML and overrides -> Config
  extensions.py  the registered extensions' own keys (actor.clip_cov.ratio), checked once trainer.imports has run
  describe.py    every key with its type, default and comment, for --help
  pools.py       the worker pools the launcher plans and the trainer starts
"""
from __future__ import annotations

from rl_megatron.config.schema import Config
from rl_megatron.config.load import load, to_dict, to_yaml
from rl_megatron.errors import ConfigError

__all__ = ["Config", "ConfigError", "load", "to_dict", "to_yaml"]
