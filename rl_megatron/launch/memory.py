"""Parameter counts and per-device memory, from a Hugging Face config.json and a parallel layout.

Counts come from the model family's Megatron <-> HF weight table (`models/family.py`): every Megatron parameter
the model has, its HF shapes and how tensor parallelism splits it, so the count is the one the trainer's shards
really have.

Memory per device (bytes), what the plan prints; activations, the CUDA context and fragmentation are NOT
included, so keep a margin:

  training state  = P_dense * (w + g + o / S_dense) + P_expert * (w + g + o / S_expert)
      P_dense, P_expert: one rank's parameters on its fullest pipeline stage (layers / PP, plus the embedding on
          the first stage and the output layer on the last), split over TP; routed experts over EP and each expert
          over expert-TP (ETP, default TP) instead
      w: weight bytes (2 for bfloat16, 4 for float32 model.dtype)
      g: gradient bytes, 4 (Megatron accumulates and reduces gradients in fp32: grad_reduce_in_fp32)
      o: optimizer bytes, 12 for bfloat16 (fp32 master copy + Adam m + v), 8 for float32 (m + v; the
          weights are their own master copy)
      S: 1 without the distributed optimizer (CPU); on GPU the distributed optimizer shards o over the
          data-parallel ranks: S_dense = DP, S_expert = DP * CP * TP / (ETP * EP) (the expert data-parallel size)
  frozen weights  = P * w (a reference model: forward only)
  rollout engine  = on GPU rollout.gpu_memory_utilization * GPU memory (vLLM takes that fraction for its
                    weights, P_total * w / rollout TP, plus the KV cache); on CPU the weights + rollout.kv_cache_bytes
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rl_megatron.models.family import moe_experts, table_for
from rl_megatron.models.weight_tables import padded_vocab_size

GIB = 1024 ** 3
WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}
GRAD_BYTES = 4  # fp32 main gradients (grad_reduce_in_fp32=True in workers/megatron_actor.py)
OPTIMIZER_BYTES = {"bfloat16": 12, "float32": 8}  # fp32 master copy (bf16 only) + Adam's two moments


@dataclass(frozen=True)
class RankParameters:
    """Parameters one rank holds on its fullest pipeline stage: those every expert-parallel rank has, and its
    share of the routed experts (their optimizer state shards over a smaller data-parallel group)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_parameters(hf: dict, tp: int = 1, pp: int = 1, ep: int = 1, vocab_divisible_by: int = 1,
                    value_head: bool = False, etp: int | None = None) -> RankParameters:
    """One rank's parameter count on its fullest pipeline stage. `value_head`: the critic, whose output layer
    is a scalar head (hidden -> 1) instead of the vocabulary projection; `etp`: the experts' TP size (default
    `tp`). tp=pp=ep=1 gives the whole model."""
    table = table_for(hf, padded_vocab_size(hf["vocab_size"], vocab_divisible_by, tp))
    experts_per_rank = moe_experts(hf) // ep
    dense_per_layer = expert_per_layer = 0
    for name, entry in table.layer.items():
        if name.startswith("mlp.experts."):  # one entry stands for every routed expert of the layer
            expert_per_layer += math.prod(entry.local_shape(etp or tp)) * experts_per_rank
        else:
            dense_per_layer += math.prod(entry.local_shape(tp))
    embedding = math.prod(table.other["embedding.word_embeddings.weight"].local_shape(tp))
    final_norm = math.prod(table.other["decoder.final_layernorm.weight"].local_shape(tp))
    if value_head:
        output = hf["hidden_size"]
    elif table.tied and pp == 1:  # one stage holds both ends: Megatron shares the embedding as output layer
        output = 0
    else:  # untied, or tied across stages: the last stage keeps its own copy
        output = math.prod(table.other["output_layer.weight"].local_shape(tp))
    layers = hf["num_hidden_layers"] // pp
    first_stage_extra = embedding + (final_norm + output if pp == 1 else 0)
    last_stage_extra = final_norm + output if pp > 1 else first_stage_extra
    dense = layers * dense_per_layer + max(first_stage_extra, last_stage_extra)
    return RankParameters(dense=dense, expert=layers * expert_per_layer)


def training_state_bytes(params: RankParameters, dtype: str, dp: int, ep: int, cp: int,
                         distributed_optimizer: bool, tp: int = 1, etp: int | None = None) -> int:
    """Weights + fp32 gradients + Adam state of one rank (see the module docstring for the formula)."""
    dense_shards = dp if distributed_optimizer else 1
    expert_shards = max(dp * cp * tp // ((etp or tp) * ep), 1) if distributed_optimizer else 1
    per_param = WEIGHT_BYTES[dtype] + GRAD_BYTES
    optimizer = OPTIMIZER_BYTES[dtype]
    return int(params.dense * (per_param + optimizer / dense_shards)
               + params.expert * (per_param + optimizer / expert_shards))


def weight_bytes(parameters: int, dtype: str) -> int:
    return parameters * WEIGHT_BYTES[dtype]
