"""Writing a Hugging Face model folder from a full HF state dict: safetensors shards with
`model.safetensors.index.json`, config.json, generation config and tokenizer files (what
`transformers.AutoModelForCausalLM.from_pretrained` and vLLM load)."""
from __future__ import annotations

import json
import os

import torch

from rl_megatron.checkpoint.model import copy_side_files
from rl_megatron.models.family import table_for
from rl_megatron.models.hf_weights import INDEX_FILE
from rl_megatron.models.mxfp4 import without_quantization_config
# The names config.json uses for a parameter dtype (transformers < 5 writes torch_dtype, >= 5 dtype).
CONFIG_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def shard_groups(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into groups of at most `max_shard_bytes` (a larger tensor gets its own)."""
    groups, size = [[]], 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_hf_folder(state_dict: dict[str, torch.Tensor], out_dir: str, hf_config: dict, side_files_dir: str | None,
                    dtype: torch.dtype, max_shard_bytes: int = 5 << 30, progress=print) -> None:
    """Write `state_dict` cast to `dtype` into the existing folder `out_dir` as an HF model folder; config.json is
    `hf_config` with its dtype field set to `dtype`, the other side files are copied from `side_files_dir`. The
    tensors are written as the family's folders store them (gpt-oss: its experts stacked)."""
    from safetensors.torch import save_file

    stored = table_for(hf_config, hf_config["vocab_size"]).stored_tensors(state_dict)
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in stored.items()}
    groups = shard_groups(tensors, max_shard_bytes)
    weight_map, total = {}, 0
    for number, names in enumerate(groups, 1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
        total += sum(tensors[name].numel() * tensors[name].element_size() for name in names)
        progress(f"wrote {file} ({len(names)} tensors)")
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    # transformers < 5 reads torch_dtype; >= 5 writes dtype, which then wins, so it is updated where present. The
    # tensors are plain even when the model came from an MXFP4 folder: no quantization_config (models/mxfp4.py).
    config = dict(without_quantization_config(hf_config), torch_dtype=CONFIG_DTYPE_NAMES[dtype])
    if "dtype" in config:
        config["dtype"] = CONFIG_DTYPE_NAMES[dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    copy_side_files(side_files_dir, out_dir)
