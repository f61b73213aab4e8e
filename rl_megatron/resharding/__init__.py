"""Megatron shards -> the Hugging Face state dict the rollout engine loads.

This is the simple, exact path: every rank gathers its tensor-parallel peers' shards, merges them with the
weight table's layouts, and the pipeline stages exchange their parts, so that every rank ends with the
full HF state dict (on the host). Memory-bounded, bucketed, shard-to-shard transfer is the resharding
module's next step; its interface stays `export_hf_state_dict`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rl_megatron.models.gpt import layer_offset
from rl_megatron.models.weight_tables import DenseTable, Replicated


@torch.no_grad()
def export_hf_state_dict(model, table: DenseTable) -> dict[str, torch.Tensor]:
    """The full HF state dict of the model whose local shard is `model` (a collective over TP and PP)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    offset = layer_offset(model)
    stage: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not table.exported(name):
            continue
        entry = table.lookup(name, offset)
        local = param.detach().contiguous()  # gloo silently corrupts non-contiguous collectives
        if tp_size == 1 or isinstance(entry.layout, Replicated):
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local, group=tp_group)
        for hf_name, tensor in zip(entry.hf_names, entry.layout.merge(shards)):
            stage[hf_name] = tensor.cpu().contiguous()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return stage
    stages: list = [None] * pp_size
    dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return {name: tensor for part in stages for name, tensor in part.items()}
