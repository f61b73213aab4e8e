"""Qwen3: Llama's layout with queries and keys RMS-normalised per head (no q/k/v biases)."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("qwen3", qk_layernorm=True))
