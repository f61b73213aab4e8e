"""What `launch/train_3d.sh --dry-run` reads: the config and the model's config.json, nothing it would download.

The plan (nodes, layouts, memory per GPU) needs only those two, so a dry run checks the config as the launch does,
less the files the run reads later (the data, the tokenizer, the weights, checkpoint folders: `preflight(...,
files=False)`), which the launch checks before Ray starts. A model folder that is not on this machine (a laptop
planning a cluster run) is stood in for by the config.json rl_megatron ships for the recipes' models,
configs/models/<name>/config.json, found by the folder's name: model.path=/models/Qwen3-30B-A3B plans with
configs/models/Qwen3-30B-A3B/config.json, and the plan says so.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional, Sequence

from rl_megatron.config import Config, load
from rl_megatron.errors import ConfigError
from rl_megatron.preflight.checks import preflight
from rl_megatron.preflight.resolve import resolve

# The checkout's configs/models (the package's folder sits beside configs/), whatever the working directory.
SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
TINY_PREFIX = "tiny-"  # the CPU demos' models, which their configs name by path


@dataclasses.dataclass
class PlanConfig:
    """A config checked for a dry run, and the model folders whose config.json a shipped one stood in for."""
    cfg: Config
    model: str  # model.path as the plan prints it
    stand_ins: dict[str, str]  # model folder named in the config -> the shipped folder read instead


def shipped_models() -> list[str]:
    """The released models whose config.json rl_megatron ships (configs/models/<name>/config.json)."""
    if not SHIPPED_MODELS.is_dir():
        return []
    return sorted(entry.name for entry in SHIPPED_MODELS.iterdir()
                  if not entry.name.startswith(TINY_PREFIX) and (entry / "config.json").is_file())


def shipped_config_folder(model_path: str) -> Optional[str]:
    """The shipped folder whose name is `model_path`'s last component (case aside), or None."""
    name = os.path.basename(os.path.normpath(model_path)).lower()
    matches = [entry for entry in shipped_models() if entry.lower() == name]
    return str(SHIPPED_MODELS / matches[0]) if matches else None


def shipped_name(folder: str) -> str:
    """A shipped folder as the checkout names it (configs/models/<name>), for messages."""
    return os.path.relpath(folder, SHIPPED_MODELS.parents[1])


def _stand_in(model_path: str, key: str) -> Optional[str]:
    """None where `model_path` exists here (its own config.json is read, as the launch reads it); else the shipped
    folder of that name; ConfigError naming `key` and what to do when there is none."""
    if os.path.exists(model_path):
        return None
    folder = shipped_config_folder(model_path)
    if folder is None:
        names = ", ".join(shipped_models()) or "none"
        raise ConfigError(f"{key}='{model_path}' is not on this machine, and rl_megatron ships no config.json for a "
                          f"model named '{os.path.basename(os.path.normpath(model_path))}' (configs/models/ has: "
                          f"{names}). A dry run reads only the model's config.json: put the model's config.json in a "
                          f"folder and point {key} at it (the launch needs the whole folder: config.json, tokenizer, "
                          "*.safetensors), or name the folder after one of those models.")
    return folder


def load_plan_config(path: str | None, overrides: Sequence[str] = (), cuda: bool = True) -> PlanConfig:
    """The config `path` with `overrides`, resolved and checked for a dry run (`cuda`: the engines run on CUDA GPUs,
    as the plan places them), model folders not on this machine stood in for by their shipped config.json."""
    cfg = resolve(load(path, overrides))
    stand_ins: dict[str, str] = {}
    model = cfg.model.path
    # Each model folder the plan reads: (its key, its section, the field naming it), where the run has the role.
    folders = [("model.path", cfg.model, "path"), ("critic.model_path", cfg.critic, "model_path"),
               ("teacher.model.path", cfg.teacher.model, "path"),
               ("reward_model.model.path", cfg.reward_model.model, "path"),
               ("judge.model.path", cfg.judge.model, "path")]
    for key, section, name in folders:
        given = getattr(section, name)
        if given is None or given in stand_ins or (key == "critic.model_path" and not cfg.critic.enable):
            continue
        folder = _stand_in(given, key)
        if folder is not None:
            stand_ins[given] = folder
    for key, section, name in folders:  # the resolved config is this dry run's own copy
        setattr(section, name, stand_ins.get(getattr(section, name), getattr(section, name)))
    preflight(cfg, cuda=cuda, files=False)
    shown = model if model not in stand_ins else (
        f"{model} (not on this machine: planned with {shipped_name(stand_ins[model])}/config.json, shipped with "
        "rl_megatron)")
    return PlanConfig(cfg, shown, stand_ins)
