"""vLLM's side of a weight sync: the engine's parameters as HF regions (`vllm_targets`, the `sync_targets` of
`VLLMEngine`), read off vLLM's own parallel layers (their TP rank, head counts, output sizes, vocabulary shard, expert
map, a Gated DeltaNet layer's head and channel counts), with the HF names of fused layers taken from the model's
`packed_modules_mapping` and its expert layers' checkpoint names (and which parts of a Gated DeltaNet's input
projection each HF tensor holds, from the model family's `InProjPacking`): the engine itself says what it expects, so
no second table can drift from it. And what vLLM derives from the weights, remade after a sync (`rederive_after_sync`).
"""
from __future__ import annotations

import torch

from rl_megatron.models.linear_attention import InProjPacking
from rl_megatron.models.weight_layouts import Region, Split, SplitSections, along, hf_module, whole
from rl_megatron.resharding.plan import TensorSpec
from rl_megatron.resharding.specs import Held


def _unpacked_names(name: str, packed: dict[str, list[str]]) -> list[str]:
    module, _, leaf = name.rpartition(".")
    prefix, _, last = module.rpartition(".")
    if last in packed:
        return [f"{prefix}.{part}.{leaf}" for part in packed[last]]
    return [name]


def _expert_regions(layer, leaf: str, param: torch.Tensor) -> list[Region]:
    """vLLM's routed experts stack this rank's experts: `w13_weight[j]` = [gate shard; up shard] and `w2_weight[j]` =
    the down projection's column shard of the global expert the layer's expert map puts in slot j (gpt-oss's
    activation, swigluoai, reads gate and up rows interleaved instead, and its biases are `w13_bias`, likewise, and
    `w2_bias`, held by the first MoE TP rank alone since the ranks' outputs are summed). Shards are over the layer's
    MoE TP ranks; the HF names are the layer's own checkpoint names."""
    parallel, experts = layer.moe_config.moe_parallel_config, layer.expert_map_manager
    rank, out = parallel.tp_rank, []
    interleaved = str(layer.moe_config.activation.value) == "swigluoai"
    for expert in experts.get_local_expert_ids():
        slot, prefix = (experts.map_global_to_local(expert),), f"{layer.layer_name}.{expert}."
        if leaf in ("w13_weight", "w13_bias"):
            n, kind = param.shape[1] // 2, leaf.rpartition("_")[2]
            shape = (n * parallel.tp_size, *param.shape[2:])
            (gate_at, up_at), every = ((0, 1), 2) if interleaved else ((0, n), 1)
            out += [along(f"{prefix}{layer.ckpt_gate_proj_name}.{kind}", shape, 0, rank * n, (rank + 1) * n, gate_at,
                          slot, every),
                    along(f"{prefix}{layer.ckpt_up_proj_name}.{kind}", shape, 0, rank * n, (rank + 1) * n, up_at,
                          slot, every)]
        elif leaf == "w2_weight":
            hidden, n = param.shape[1], param.shape[2]
            out.append(along(prefix + layer.ckpt_down_proj_name + ".weight", (hidden, n * parallel.tp_size), 1,
                             rank * n, (rank + 1) * n, 0, slot))
        elif leaf == "w2_bias":  # the other ranks' stay zero (`zero_what_no_region_holds`)
            out += [along(prefix + layer.ckpt_down_proj_name + ".bias", tuple(param.shape[1:]), 0, 0,
                          param.shape[1], 0, slot)] if rank == 0 else []
        else:
            raise NotImplementedError(f"vLLM expert parameter '{leaf}' of '{layer.layer_name}' has no HF mapping yet "
                                      "(expert biases and quantised experts are not supported).")
    return out


def _sections_per_tensor(names: list[str], packing: InProjPacking) -> list[int]:
    """How many of a fused layer's output sizes each of its HF tensors `names` fills, in order: one, except where a
    Gated DeltaNet's input projection keeps each part whole (`packing`: Qwen3.5's in_proj_qkv holds q, k and v,
    which vLLM's in_proj_qkvz lays out as three output sizes, each split over TP by itself). Grouped per key head
    (Qwen3-Next), a tensor is one output size, its key heads split over TP."""
    whole_parts = {} if packing.grouped_per_key_head else dict(packing.tensors)
    return [len(whole_parts[hf_module(name)]) if hf_module(name) in whole_parts else 1 for name in names]


def _vllm_regions(module, leaf: str, param: torch.Tensor, names: list[str], owner,
                  packing: InProjPacking) -> list[Region]:
    """The HF regions `param` (`module`'s parameter `leaf`; `owner`: the module that holds `module`) keeps;
    `packing`: how the model's HF folders store a Gated DeltaNet's input projection."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, RoutedExperts):
        return _expert_regions(module, leaf, param)
    if leaf == "sinks":  # gpt-oss's attention sink logits, one per query head: split over TP with the heads
        n, rank = param.shape[0], module.qkv_proj.tp_rank
        return [along(names[0], (n * module.qkv_proj.tp_size,), 0, rank * n, (rank + 1) * n, 0)]
    tail = tuple(param.shape[1:])
    if isinstance(module, QwenGatedDeltaNetAttention):  # A_log, dt_bias: one per value head, split with the heads
        return Split(0).regions(names, [(param.shape[0] * module.tp_size,)], module.tp_rank, module.tp_size)
    if isinstance(owner, QwenGatedDeltaNetAttention) and module is owner.conv1d:
        # Its channels are [q | k | v], each section split over TP (vLLM's mamba_v2_sharded_weight_loader).
        sections = SplitSections((owner.key_dim, owner.key_dim, owner.value_dim))
        return sections.regions(names, [(owner.conv_dim, *tail)], owner.tp_rank, owner.tp_size)
    if isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.v_head_size
        q_total = module.total_num_heads * module.head_size
        kv_total = module.total_num_kv_heads * module.v_head_size
        kv_rank = module.tp_rank // module.num_kv_head_replicas  # vLLM repeats KV heads when TP > KV heads
        return [along(names[0], (q_total, *tail), 0, module.tp_rank * q, (module.tp_rank + 1) * q, 0),
                along(names[1], (kv_total, *tail), 0, kv_rank * kv, (kv_rank + 1) * kv, q),
                along(names[2], (kv_total, *tail), 0, kv_rank * kv, (kv_rank + 1) * kv, q + kv)]
    if isinstance(module, MergedColumnParallelLinear):
        # Each output size is split over TP by itself; an HF tensor fills one or more of them, one after another.
        out, at, sizes = [], 0, iter(module.output_sizes)
        for name, count in zip(names, _sections_per_tensor(names, packing)):
            sections, start = [next(sizes) for _ in range(count)], 0
            for total in sections:
                n = total // module.tp_size
                out.append(along(name, (sum(sections), *tail), 0, start + module.tp_rank * n,
                                 start + (module.tp_rank + 1) * n, at))
                at, start = at + n, start + total
        return out
    if isinstance(module, ColumnParallelLinear):
        n = module.output_size_per_partition
        return [along(names[0], (module.output_size, *tail), 0, module.tp_rank * n, (module.tp_rank + 1) * n, 0)]
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        n = module.input_size_per_partition
        shape = (module.output_size, module.input_size)
        return [along(names[0], shape, 1, module.tp_rank * n, (module.tp_rank + 1) * n, 0)]
    if isinstance(module, VocabParallelEmbedding):
        shard = module.shard_indices
        shape = (module.org_vocab_size, module.embedding_dim)
        if shard.org_vocab_start_index >= shard.org_vocab_end_index:
            return []
        return [along(names[0], shape, 0, shard.org_vocab_start_index, shard.org_vocab_end_index, 0)]
    return [whole(names[0], tuple(param.shape))]


# Parameters vLLM derives from others once they are loaded, rather than loads: multi-head latent attention's per-head
# copies of kv_b_proj for decoding (vLLM's MLAAttention). `rederive_after_sync` makes them again after a sync.
DERIVED = ("W_UK_T", "W_UV")


def rederive_after_sync(model) -> None:
    """Recompute what vLLM derives from the weights a sync wrote (`DERIVED`): in place, as vLLM reloads weights."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.process_weights_after_loading(module.kv_b_proj.weight.dtype)


def _hf_name(mapper, name: str) -> str:
    """The HF name of a vLLM parameter that vLLM's model class renames (gpt-oss: self_attn -> attn, embed_tokens ->
    embedding): the first substitution back whose forward mapping gives `name` again; `name` where none does."""
    if mapper is None:
        return name
    candidates = [name.replace(new, old, 1) for old, new in mapper.orig_to_new_substr.items() if new and new in name]
    candidates += [old.join(name.rsplit(new, 1)) for old, new in mapper.orig_to_new_suffix.items()
                   if new and name.endswith(new)]
    return next((candidate for candidate in candidates if mapper.map_name(candidate) == name), name)


def vllm_targets(model, packing: InProjPacking) -> Held:
    """The engine's parameters on this rank (vLLM names) and the HF regions vLLM keeps in each (not those it
    derives: `DERIVED`); `packing`: the model family's `in_proj_packing`."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    held = {}
    for name, param in model.named_parameters():
        if name.rpartition(".")[2] in DERIVED:
            continue
        if param.numel() == 0:
            raise RuntimeError(f"vLLM parameter '{name}' is empty: the engine repacked it for its CPU kernels, "
                               "so it cannot be updated in place (start engines through rl_megatron's VLLMEngine).")
        module_name, _, leaf = name.rpartition(".")
        # An engine serving LoRA wraps each linear layer that can take adapters: `<layer>.base_layer.weight`.
        hf_like = _hf_name(getattr(model, "hf_to_vllm_mapper", None), name.replace(".base_layer.", "."))
        regions = _vllm_regions(model.get_submodule(module_name), leaf, param, _unpacked_names(hf_like, packed),
                                model.get_submodule(module_name.rpartition(".")[0]), packing)
        held[name] = (param.detach(), TensorSpec(name, tuple(param.shape), param.dtype, tuple(regions)))
    return held
