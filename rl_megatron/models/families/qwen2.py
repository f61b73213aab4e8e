"""Qwen2 (and Qwen2.5): Llama's layout with biases on the q/k/v projections."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("qwen2", qk_layernorm=False, qkv_bias_key=None, qkv_bias_default=True))
