"""Llama: plain attention (q/k/v biases when config.json's attention_bias says so), a gated MLP."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("llama", qk_layernorm=False))
