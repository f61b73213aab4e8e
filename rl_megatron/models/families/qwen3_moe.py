"""Qwen3-MoE: Qwen3's attention; a layer's MLP is a softmax router over routed experts (no shared expert), whose
top-k weights are not renormalised unless config.json's norm_topk_prob says so; layers listed in mlp_only_layers
(or off the decoder_sparse_step) keep a dense MLP."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec, qwen_sparse_layers
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "qwen3_moe", qk_layernorm=True,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=False, sparse_layers=qwen_sparse_layers)))
