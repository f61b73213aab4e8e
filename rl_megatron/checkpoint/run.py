"""The trainer's checkpoints: one folder per saved step under trainer.checkpoint_dir,

    global_step_40/
        actor/               Megatron distributed checkpoint: weights, Adam state, LR schedule (loads at any layout)
        critic/              the same for the value model, when there is one
        ref/                 the reference's weights, only when model.path cannot rebuild them (model.random_init)
        rng/                 each worker's RNG states (restored when the layout is unchanged)
        rollouts_ahead.pt    the batches already generated for the next steps (trainer.rollout_staleness > 0), or a
                             streaming run's queue and unfinished prompts (trainer.async_mode=streaming)
        trainer_state.json   step, data-loader position, KL coefficient, reward history
        config.yaml          the resolved config of the run that saved it
    latest_checkpointed_iteration.txt   the newest complete step (verl's and Megatron's name), written last

A step is written into `global_step_N.incomplete`, fsynced, and renamed; the pointer is replaced (write, fsync,
rename) only then, and older steps beyond trainer.keep_last are deleted after that. A crash at any point leaves
every complete step folder intact and the pointer naming one of them.

Resuming (`trainer.resume`): "auto" takes the pointer's step, falling back (with a warning) to the newest older
step that passes the checks when it is missing or damaged; "off" starts over; a path takes that step folder.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import torch

from rl_megatron.checkpoint.atomic import PARTIAL_SUFFIX, finish_partial, partial_path, replace_file, start_partial
from rl_megatron.checkpoint.model import METADATA_FILE, CheckpointError, check_checkpoint, read_json
from rl_megatron.config import Config
from rl_megatron.config.pools import reference_in_actor, uses_reference
from rl_megatron.roles import Role

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
ROLLOUTS_FILE = "rollouts_ahead.pt"  # the batches generated ahead of the saved step (trainer.rollout_staleness > 0)
STATE_FORMAT = "rl_megatron.trainer_state"
STATE_VERSION = 1
_STEP_FOLDER = re.compile(r"global_step_(\d+)")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged or partial) and an older one used instead."""


def checkpointed_roles(cfg: Config) -> tuple[Role, ...]:
    """The models a checkpoint holds (each in the folder of its role's name): the trainable ones, and the reference
    when model.path cannot rebuild it (a LoRA actor's frozen base is the reference: saved with the actor)."""
    reference = uses_reference(cfg) and not reference_in_actor(cfg) and cfg.model.random_init
    return (Role.ACTOR, *((Role.CRITIC,) if cfg.critic.enable else ()), *((Role.REF,) if reference else ()))


def checkpoint_root(cfg: Config) -> str:
    """Where the run's step folders go: trainer.checkpoint_dir, or <log_dir>/<experiment_name>/checkpoints."""
    return cfg.trainer.checkpoint_dir or os.path.join(cfg.trainer.run_dir, "checkpoints")


def resume_hint(cfg: Config) -> str:
    """What the same command does if run again now, for a user whose run just failed."""
    root = checkpoint_root(cfg)
    try:
        step = latest_step(root)
    except CheckpointError:
        step = None
    if step is None:
        return (f"No checkpoint was saved yet (under {root}): the same command starts the run over "
                "(trainer.save_every=N saves every N steps).")
    if cfg.trainer.resume == "off":
        return f"The last checkpoint is step {step} ({step_dir(root, step)}); trainer.resume=auto resumes from it."
    return f"The last checkpoint is step {step} ({step_dir(root, step)}); the same command resumes from it."


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def saved_steps(root: str) -> list[int]:
    """Steps with a complete folder under `root` (renamed from .incomplete), newest first."""
    if not os.path.isdir(root):
        return []
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := _STEP_FOLDER.fullmatch(name))]
    return sorted(steps, reverse=True)


def latest_step(root: str) -> int | None:
    """The step the pointer file names; None without a pointer. A damaged pointer raises CheckpointError."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"'{path}' should hold a step number, not {text[:40]!r}.")
    return int(text)


def start_save(root: str, step: int) -> str:
    """The folder to write step `step` into (empty; a leftover of an interrupted save is removed)."""
    return start_partial(step_dir(root, step))


def finish_save(root: str, step: int, trainer_state: dict, config_yaml: str, keep_last: int) -> str:
    """Complete step `step` (whose workers' parts are in `start_save`'s folder): write the controller's state,
    make it all durable, rename, point `latest` at it, then delete complete steps beyond the newest `keep_last`
    (0 keeps all) and what interrupted saves left. Returns the step folder."""
    final = step_dir(root, step)
    partial = partial_path(final)
    with open(os.path.join(partial, "config.yaml"), "w") as f:
        f.write(config_yaml)
    with open(os.path.join(partial, STATE_FILE), "w") as f:  # written last: its presence says the rest is there
        json.dump({"format": STATE_FORMAT, "format_version": STATE_VERSION, "step": step, **trainer_state}, f,
                  indent=1)
    # The same step saved again (e.g. a resumed run stopped at once): the new one wins.
    finish_partial(final, replace=True)
    replace_file(os.path.join(root, LATEST_FILE), f"{step}\n")
    stale = [name for name in os.listdir(root) if name.endswith(PARTIAL_SUFFIX)]  # left by interrupted saves
    if keep_last > 0:
        stale += [os.path.basename(step_dir(root, old)) for old in saved_steps(root)[keep_last:]]
    for name in stale:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return final


def read_trainer_state(folder: str) -> dict:
    path = os.path.join(folder, STATE_FILE)
    state = read_json(path, "the trainer's state, written last into every step folder")
    if state.get("format") != STATE_FORMAT or state.get("format_version") != STATE_VERSION:
        raise CheckpointError(f"'{path}' is format {state.get('format')!r} version {state.get('format_version')!r}; "
                              f"this version of rl_megatron reads {STATE_FORMAT!r} version {STATE_VERSION}.")
    return state


def check_step(folder: str, hf_config: dict, roles: tuple[Role, ...], expert_parallel: int = 1) -> dict:
    """Everything checkable before loading a step folder for `roles` (each one's Megatron checkpoint: metadata,
    config against `hf_config`, shard files) into an actor of `expert_parallel` EP. Returns its trainer state."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"'{folder}' is not a folder; trainer.resume takes a step folder such as "
                              "<checkpoint_dir>/global_step_40, or auto / off.")
    state = read_trainer_state(folder)
    for role in map(Role, roles):  # Role members, or their names
        metadata = check_checkpoint(os.path.join(folder, role), hf_config)
        if role.trainable and not metadata.get("training_state"):
            raise CheckpointError(f"'{os.path.join(folder, role)}' holds weights only, no optimizer state.")
    saved_ep = read_json(os.path.join(folder, "actor", METADATA_FILE), "")["source_layout"]["ep"]
    # Megatron keeps the experts' Adam state in an optimizer of its own only at EP > 1, and its checkpoints do not
    # convert between one optimizer and two: EP may change (2 -> 4), but not across 1.
    if (saved_ep > 1) != (expert_parallel > 1):
        raise CheckpointError(
            f"'{folder}' was saved at actor.expert_model_parallel_size={saved_ep}; its optimizer state cannot resume "
            f"at {expert_parallel} (Megatron splits the optimizer in two at EP > 1, and only then). Resume at an EP "
            f"{'> 1' if saved_ep > 1 else 'of 1'}, or start from its weights alone: "
            f"model.checkpoint={os.path.join(folder, 'actor')} trainer.resume=off.")
    return state


def choose_resume(root: str, resume: str, hf_config: dict, roles: tuple[Role, ...],
                  expert_parallel: int = 1) -> tuple[str, dict] | None:
    """(step folder, trainer state) to resume from, or None to start over (see the module's docstring)."""
    if resume == "off":
        return None
    if resume != "auto":
        return resume, check_step(resume, hf_config, roles, expert_parallel)
    candidates = saved_steps(root)
    problems = []
    try:
        pointed = latest_step(root)
    except CheckpointError as err:
        pointed = None
        problems.append(str(err))
    if pointed is not None:
        # The pointer is written after its folder is complete: steps newer than it are not to be trusted.
        candidates = [step for step in candidates if step <= pointed]
        if pointed not in candidates:
            problems.append(f"'{os.path.join(root, LATEST_FILE)}' names step {pointed}, whose folder "
                            f"'{step_dir(root, pointed)}' is missing.")
    for step in candidates:
        folder = step_dir(root, step)
        try:
            state = check_step(folder, hf_config, roles, expert_parallel)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        if problems:
            warnings.warn(f"Resuming from the older checkpoint '{folder}' because: {' '.join(problems)}",
                          CheckpointWarning, stacklevel=2)
        return folder, state
    if problems:
        raise CheckpointError(f"No usable checkpoint under '{root}': {' '.join(problems)} Set trainer.resume=off "
                              "to start over (the folders are kept), or trainer.resume=PATH to pick one.")
    return None


def save_rollouts_ahead(folder: str, rollouts: list) -> None:
    """The batches generated ahead of the step being saved (`rl_megatron.trainer.rollout_ahead.Rollout`s), into its
    folder (`start_save`'s): a resumed run trains on them rather than generating them again."""
    if rollouts:
        torch.save(rollouts, os.path.join(folder, ROLLOUTS_FILE))


def load_rollouts_ahead(folder: str) -> list:
    path = os.path.join(folder, ROLLOUTS_FILE)
    return torch.load(path, weights_only=False) if os.path.exists(path) else []
