"""Qwen3-MoE: Qwen3's attention; every layer's MLP is a softmax router over routed experts (no shared expert),
whose top-k weights are not renormalised unless config.json's norm_topk_prob says so."""
from rl_megatron.models.family import ModelFamily, MoeSpec, register
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "qwen3_moe", always_qkv_bias=False, qk_layernorm=True,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=False)))
