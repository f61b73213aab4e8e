"""Mistral: Llama's layout; config.json's sliding_window, where set, limits every layer's attention to that many
positions (Mistral-7B v0.1: 4096; v0.3 and later leave it null)."""
from rl_megatron.models.family import ModelFamily, register

FAMILY = register(ModelFamily("mistral", qk_layernorm=False, sliding_window=True))
