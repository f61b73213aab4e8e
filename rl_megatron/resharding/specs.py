"""What each side holds, as HF regions: Megatron shards (sources), and an engine's parameters or full HF tensors
(targets).

The Megatron side comes from the family's weight table. An engine's side is what the engine says it holds (its
`sync_targets`: vLLM's, `rollout/vllm_weights.py`, read off vLLM's own parallel layers), so no second table can drift
from it.
"""
from __future__ import annotations

import torch

from rl_megatron.models.weight_layouts import whole
from rl_megatron.models.weight_tables import DenseTable
from rl_megatron.resharding.plan import TensorSpec
from rl_megatron.resharding.shared_params import location

Held = dict[str, tuple[torch.Tensor, TensorSpec]]  # key -> (the local tensor, what it holds)


def megatron_sources(chunks: list, table: DenseTable,
                     substitutes: dict[int, torch.Tensor] | None = None) -> tuple[Held, list[str]]:
    """This rank's Megatron parameters (every virtual-pipeline chunk) and the shape errors found. `substitutes`:
    id(parameter) -> the tensor to read in its place (a LoRA actor's merged weights, models/lora.py)."""
    from rl_megatron.models.gpt import expert_offset, hf_parameters, layer_offset, tp_shard

    held, errors = {}, []
    for vp, chunk in enumerate(chunks):
        offset, experts = layer_offset(chunk), expert_offset(chunk)
        for name, param in hf_parameters(chunk):
            try:
                entry = table.lookup(name, offset, experts)
            except KeyError as error:
                errors.append(str(error.args[0]))
                continue
            tp_rank, tp_size = tp_shard(name)
            expected = entry.local_shape(tp_size)
            if tuple(param.shape) != expected:
                errors.append(f"Megatron parameter '{name}' has shape {tuple(param.shape)} but the weight table "
                              f"expects {expected} (from {', '.join(entry.hf_names)})")
                continue
            key, tensor = f"chunk{vp}.{name}", (substitutes or {}).get(id(param), param).detach()
            held[key] = (tensor, TensorSpec(key, expected, param.dtype, tuple(entry.regions(tp_rank, tp_size)),
                                            location(tensor)))
    return held, errors


def zero_what_no_region_holds(targets: Held) -> None:
    """Zero the engine's parameters (`targets`: its `sync_targets`) that hold no HF region on this rank (gpt-oss's
    expert output biases beyond the first MoE TP rank; vocabulary padding): no sync writes them, and a dummy-loaded
    engine starts them random, as a wake from a level-2 sleep leaves them (the phase machine's "zero_unheld" move)."""
    for tensor, spec in targets.values():
        if not spec.regions:
            tensor.zero_()


def hf_shapes(sources: list[list[TensorSpec]]) -> dict[str, tuple[tuple, torch.dtype]]:
    """Every HF tensor the sources make up: name -> (shape, dtype), in name order."""
    shapes: dict[str, tuple] = {}
    for specs in sources:
        for spec in specs:
            for region in spec.regions:
                shapes.setdefault(region.hf_name, (tuple(region.hf_shape), spec.dtype))
    return dict(sorted(shapes.items()))


def hf_target(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, TensorSpec]:
    """`tensor` as the target of the whole HF tensor `name`."""
    shape = tuple(tensor.shape)
    return tensor, TensorSpec(name, shape, tensor.dtype, (whole(name, shape),))


def hf_targets(sources: list[list[TensorSpec]]) -> Held:
    """Every HF tensor the sources make up, whole, newly allocated on this rank (export, conversion)."""
    return {name: hf_target(name, torch.empty(shape, dtype=dtype))
            for name, (shape, dtype) in hf_shapes(sources).items()}
