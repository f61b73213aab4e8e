"""A config made ready to run: its derived values filled in (`resolve`) and everything checked before anything starts
(`preflight`), against the code, the model folder and the data. `load_config` does both on what
`rl_megatron.config.load` reads.

  resolve.py  derived values (rollout.max_model_len, critic and reference sizes, critic.enable, data files), and the
              registered names (policy loss, advantage estimator) once trainer.imports has run
  checks.py   the checks of keys together, and each package's own (data, rewards, models, agents, tracking)
  layout.py   parallel layouts against devices, batches and the model
  dry_run.py  what `launch/train_3d.sh --dry-run` checks: the config and config.json only (a shipped one for a model
              folder that is not on this machine)
"""
from __future__ import annotations

from typing import Sequence

from rl_megatron.config import Config, load
from rl_megatron.preflight.checks import preflight
from rl_megatron.preflight.resolve import resolve

__all__ = ["load_config", "preflight", "resolve"]


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """The config `path` (YAML) and `overrides` (`a.b=value`) describe, its derived values filled in and checked
    before anything starts (ConfigError naming the key and the fix)."""
    cfg = resolve(load(path, overrides))
    preflight(cfg)
    return cfg
