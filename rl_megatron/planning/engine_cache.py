"""What a vLLM engine's cache holds for one sample, from config.json, and so how many samples of rollout.max_model_len
the memory left beside its weights serves at once (the plan's engine line, on GPU).

Per token, every attention layer keeps its keys and values, on each TP rank its share of the key/value heads (a head
shared by ranks where TP exceeds them); multi-head latent attention (DeepSeek) keeps its compressed latent and rotary
key instead, whole on every rank. A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps no per-token cache: per sequence,
its causal convolution's last kernel - 1 inputs (queries, keys and values) and its recurrent state, a key x value
matrix per value head, both split over TP by heads. Both in the model's dtype (vLLM's "auto" cache dtypes).
Sliding windows (gpt-oss's every other layer) are counted at full length: an upper bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl_megatron.models.family import family_of
from rl_megatron.models.linear_attention import DeltaNetShape, linear_attention_layers
from rl_megatron.planning.layer_memory import WEIGHT_BYTES


@dataclass(frozen=True)
class SampleCache:
    """An engine rank's cache for one sample: `token_bytes` per token (the attention layers'), `state_bytes` per
    sequence (the Gated DeltaNet layers')."""
    token_bytes: int
    state_bytes: int

    def sample_bytes(self, tokens: int) -> int:
        return tokens * self.token_bytes + self.state_bytes


def sample_cache(hf: dict, tp: int, dtype: str) -> SampleCache:
    """The cache one sample takes on each of an engine's `tp` ranks, for the model of config.json `hf`."""
    width = WEIGHT_BYTES[dtype]
    linear = linear_attention_layers(hf) if family_of(hf).gated_delta_net else [False] * hf["num_hidden_layers"]
    attention_layers = linear.count(False)
    if family_of(hf).mla:
        per_layer = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    else:
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        per_layer = 2 * -(-kv_heads // tp) * (hf.get("head_dim") or hf["hidden_size"] // heads)
    state = 0
    if any(linear):
        shape = DeltaNetShape.of(hf)
        convolution = (2 * shape.qk + shape.v) * (shape.conv_width - 1)
        recurrent = shape.value_heads * shape.key_dim * shape.value_dim
        state = linear.count(True) * (convolution + recurrent) // tp
    return SampleCache(attention_layers * per_layer * width, state * width)
