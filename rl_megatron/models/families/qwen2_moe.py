"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases unless config.json's qkv_bias says
otherwise); a layer's MLP is a softmax router over routed experts plus one shared expert whose output a sigmoid
gate scales; layers listed in mlp_only_layers (or off the decoder_sparse_step) keep a dense MLP."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec, SharedExperts, qwen_sparse_layers
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "qwen2_moe", qk_layernorm=False, qkv_bias_key="qkv_bias", qkv_bias_default=True,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=False, sparse_layers=qwen_sparse_layers,
                shared=SharedExperts(module="shared_expert", width_key="shared_expert_intermediate_size",
                                     gate="shared_expert_gate"))))
