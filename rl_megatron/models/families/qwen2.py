"""Qwen2 (and Qwen2.5): Llama's layout with biases on the q/k/v projections."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("qwen2", always_qkv_bias=True, qk_layernorm=False))
