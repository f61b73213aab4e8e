"""Qwen3: Llama's layout with queries and keys RMS-normalised per head (no q/k/v biases)."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("qwen3", always_qkv_bias=False, qk_layernorm=True))
