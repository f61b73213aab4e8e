"""Model checkpoints in Megatron's distributed format: the chunks' `sharded_state_dict()` saved with
`megatron.core.dist_checkpointing` (torch_dist backend), so any TP/PP layout can load them, next to the model's
HF config.json, generation config and tokenizer files and a small metadata JSON. A checkpoint folder is thus
self-contained: it can be loaded into a trainer or converted back to an HF folder with nothing else.

Loading checks the checkpoint before any byte is read into the model: metadata present and of a known format,
the stored config equal (in every field that shapes or changes the model) to the config the model was built
from, and every shard file present and as long as the index says (slime#1059: a mismatched config silently
trains garbage).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.atomic import finish_partial, partial_path, start_partial
from rl_megatron.config.choices import lora_modules
from rl_megatron.errors import CheckpointError
from rl_megatron.models.family import family_fields, head_dim
from rl_megatron.models.rotary import partial_rotary_factor, rope_scaling, rope_theta

METADATA_FILE = "rl_megatron_checkpoint.json"
FORMAT = "rl_megatron.model_checkpoint"
FORMAT_VERSION = 1
# Written by torch.distributed.checkpoint (the shard index) and by Megatron's dist_checkpointing (its backend).
SHARD_INDEX_FILE = ".metadata"
MEGATRON_METADATA_FILE = "metadata.json"
# What an HF model folder holds besides weights, copied into checkpoints and back out of them.
HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                 "chat_template.json")


def config_fields(hf_config: dict) -> dict:
    """The config.json fields (resolved to their effective values) that decide the model's tensors or its
    computation: two configs that agree on these describe the same model."""
    heads = hf_config["num_attention_heads"]
    return {
        "model_type": hf_config.get("model_type"),
        "num_hidden_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "intermediate_size": hf_config.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": hf_config.get("num_key_value_heads") or heads,
        "head_dim": head_dim(hf_config),
        "vocab_size": hf_config["vocab_size"],
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "rms_norm_eps": hf_config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(hf_config),
        **family_fields(hf_config),
        # Only where set, so that the checkpoints of models without them keep their recorded hash.
        **{key: value for key, value in (("rope_scaling", rope_scaling(hf_config)),
                                         ("partial_rotary_factor", partial_rotary_factor(hf_config)))
           if value not in (None, 1.0)},
    }


def config_sha256(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def config_differences(stored: dict, given: dict) -> list[str]:
    """'field: checkpoint X, model Y' for every field of `config_fields` in which two configs differ."""
    a, b = config_fields(stored), config_fields(given)
    return [f"{key}: checkpoint {a.get(key)!r}, model {b.get(key)!r}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"'{path}' is missing: {what}.")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"'{path}' is not readable JSON ({err}): {what}.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object, not a {type(value).__name__}: {what}.")
    return value


def read_checkpoint_metadata(ckpt_dir: str) -> dict:
    """The checkpoint's metadata, checked for format and consistency with its stored config.json."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"'{ckpt_dir}' is not a folder; expected a checkpoint written by "
                              "`python -m rl_megatron.convert from-hf` or the trainer.")
    metadata = read_json(os.path.join(ckpt_dir, METADATA_FILE),
                         "every rl_megatron checkpoint has it; a folder without it was not completely written")
    if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"'{os.path.join(ckpt_dir, METADATA_FILE)}' says format {metadata.get('format')!r} version "
            f"{metadata.get('format_version')!r}; this version of rl_megatron reads {FORMAT!r} "
            f"version {FORMAT_VERSION}.")
    stored = config_fields(stored_hf_config(ckpt_dir))
    if config_sha256(stored) != metadata.get("config_sha256"):
        changed = [f"{key}: metadata {value!r}, config.json {stored.get(key)!r}"
                   for key, value in (metadata.get("config_fields") or {}).items() if stored.get(key) != value]
        raise CheckpointError(f"'{os.path.join(ckpt_dir, 'config.json')}' no longer describes the weights saved "
                              f"with it (edited after saving?): {'; '.join(changed) or 'config hash differs'}.")
    return metadata


def stored_hf_config(ckpt_dir: str) -> dict:
    return read_json(os.path.join(ckpt_dir, "config.json"), "the model's HF config, saved with the weights")


def verify_shard_files(ckpt_dir: str) -> None:
    """Every shard file the index names exists and is as long as the index says."""
    from torch.distributed.checkpoint import FileSystemReader

    for name in (MEGATRON_METADATA_FILE, SHARD_INDEX_FILE):
        if not os.path.isfile(os.path.join(ckpt_dir, name)):
            raise CheckpointError(f"'{os.path.join(ckpt_dir, name)}' is missing: the checkpoint's Megatron shards "
                                  "were not completely written.")
    try:
        index = FileSystemReader(ckpt_dir).read_metadata()
    except Exception as err:  # a truncated or foreign index fails inside pickle in many ways
        raise CheckpointError(f"'{os.path.join(ckpt_dir, SHARD_INDEX_FILE)}' (the shard index) cannot be read: "
                              f"{type(err).__name__}: {err}") from None
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"Shard file '{path}' is missing (the checkpoint's index names it).")
        if os.path.getsize(path) < size:
            raise CheckpointError(f"Shard file '{path}' is truncated: {os.path.getsize(path)} bytes, the index "
                                  f"needs at least {size}.")


def _sharded_state_dict(chunks: list, optimizer=None, scheduler=None, loading: bool = False) -> dict:
    # Keyed per model chunk; the tensors inside carry global keys and offsets, so the chunking need not match.
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    if optimizer is not None:
        # Adam's moments are sharded like the parameters they belong to, so they reshard with them; the LR
        # schedule is a few numbers, kept whole (Megatron saves non-sharded values once, in common.pt).
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=loading)
        state["scheduler"] = scheduler.state_dict()
    return state


def _layout() -> dict:
    from megatron.core import parallel_state

    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "etp": parallel_state.get_expert_tensor_parallel_world_size(),
            "world_size": dist.get_world_size()}


def copy_side_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy the HF folder's generation config and tokenizer files that exist; returns their names."""
    copied = []
    for name in HF_SIDE_FILES:
        if src_dir and os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def _all_ranks_agree_on_error(error: str | None) -> None:
    """Raise the first rank's error on every rank, so none waits in a collective for a rank that gave up."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _in_process_write_results_queue() -> None:
    """megatron-core's torch_dist writer hands a save's write results over a queue that it creates on first use as a
    `spawn` Manager's: a server process per rank, which re-imports the worker's main module and torch (the demo's first
    save took 4.6 s instead of 0.3 s, on 2 cores). Saves here are synchronous, the results put and read in this
    process, where a plain queue serves. Left alone where a later megatron-core has no such queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


@torch.no_grad()
def _adapter_shape(lora: dict | None) -> tuple | None:
    """What of actor.lora a checkpoint's adapters are made of (None: no adapters)."""
    if not lora or not lora.get("rank"):
        return None
    return lora["rank"], lora["alpha"], lora_modules(lora["target_modules"])


def save_model_checkpoint(chunks: list, ckpt_dir: str, hf_config: dict, hf_files_dir: str | None = None, *,
                          optimizer=None, scheduler=None, lora: dict | None = None) -> None:
    """Save this rank's model chunks (a collective over every rank) as a self-contained checkpoint in `ckpt_dir`,
    which must not exist. Written into `<ckpt_dir>.incomplete`, fsynced and renamed at the end, so `ckpt_dir` either
    holds a whole checkpoint or nothing. `hf_files_dir`: the HF folder whose generation config and tokenizer to copy.
    With `optimizer` (and its LR `scheduler`) the training state is saved too, to resume training from. `lora`: the
    chunks' LoRA adapters (actor.lora's keys), recorded in the metadata."""
    from megatron.core import dist_checkpointing

    _in_process_write_results_queue()
    partial = partial_path(ckpt_dir)
    error = None
    if os.path.exists(ckpt_dir):
        error = f"'{ckpt_dir}' already exists; choose a new folder (checkpoints are never overwritten)."
    elif dist.get_rank() == 0:
        start_partial(ckpt_dir)  # emptied of what an interrupted save left
    _all_ranks_agree_on_error(error)
    dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, scheduler), partial)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        side_files = copy_side_files(hf_files_dir, partial)
        fields = config_fields(hf_config)
        metadata = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "source_layout": _layout(),
            "dtype": str(next(chunks[0].parameters()).dtype).removeprefix("torch."),
            "model_type": hf_config.get("model_type"),
            "padded_vocab_size": chunks[0].vocab_size,
            "config_fields": fields, "config_sha256": config_sha256(fields),
            "hf_side_files": side_files,
            "training_state": optimizer is not None,
            "lora": lora,
        }
        # Written last: a folder with the metadata file holds everything else.
        with open(os.path.join(partial, METADATA_FILE), "w") as f:
            json.dump(metadata, f, indent=2)
        finish_partial(ckpt_dir)
    dist.barrier()


def check_checkpoint(ckpt_dir: str, hf_config: dict) -> dict:
    """Everything that can be checked without loading: metadata, the stored config against `hf_config` (naming
    every differing field) and the shard files. Returns the metadata."""
    metadata = read_checkpoint_metadata(ckpt_dir)
    differences = config_differences(stored_hf_config(ckpt_dir), hf_config)
    if differences:
        raise CheckpointError(f"Checkpoint '{ckpt_dir}' was saved from a different model than the config.json "
                              f"given now describes: {'; '.join(differences)}.")
    verify_shard_files(ckpt_dir)
    return metadata


@torch.no_grad()
def load_checkpoint_into(chunks: list, ckpt_dir: str, hf_config: dict, *, optimizer=None, scheduler=None,
                         lora: dict | None = None) -> dict:
    """Load the checkpoint into this rank's model chunks, built from `hf_config` at any TP/PP/VPP layout, vocabulary
    padding and parameter dtype (values are cast to the chunks' dtype), and with `optimizer` its training state
    (Adam's moments, resharded like the weights; the LR schedule's step count). A collective over every rank.
    Checks first (see `check_checkpoint`; `lora`: the chunks' adapters, which must be the checkpoint's); returns the
    checkpoint's metadata."""
    from megatron.core import dist_checkpointing

    error = metadata = None
    try:
        metadata = check_checkpoint(ckpt_dir, hf_config)
        if _adapter_shape(metadata.get("lora")) != _adapter_shape(lora):
            raise CheckpointError(
                f"Checkpoint '{ckpt_dir}' holds LoRA adapters {metadata.get('lora')}, but the model loading it has "
                f"{lora}: resume with actor.lora set to the checkpoint's (rank, alpha, target_modules); to start a new "
                "run from a LoRA checkpoint, convert it with `python -m rl_megatron.convert to-hf` (the adapters "
                "merged) and use that folder as model.path.")
        if optimizer is not None and not metadata.get("training_state"):
            raise CheckpointError(f"Checkpoint '{ckpt_dir}' holds model weights only (no optimizer state) and "
                                  "cannot resume training; start from it with model.checkpoint instead.")
    except CheckpointError as err:
        error = str(err)
    _all_ranks_agree_on_error(error)
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, scheduler, loading=True), ckpt_dir)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    return metadata
