"""Megatron GPT models built from Hugging Face config.json files, the Megatron <-> HF weight tables, log-probs
from vocabulary-parallel logits, and MoE router metrics."""
