"""Megatron GPT models built from Hugging Face config.json files, the Megatron <-> HF weight tables, log-probs
from vocabulary-parallel logits, MoE router metrics, and the model folder's pre-flight checks (its tokenizer, its
safetensors headers against the weight table)."""
