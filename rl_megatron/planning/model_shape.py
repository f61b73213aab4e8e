"""The sizes a model's activations are made of, from its config.json (`memory.py`'s formulas read them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_megatron.models.family import family_of, head_dim
from rl_megatron.models.rotary import partial_rotary_factor


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's sizes (config.json's names: DeepSeek-V2/V3, Moonlight)."""

    q_lora_rank: int  # 0: queries projected straight from the hidden state (config.json's null)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, hf: dict) -> Optional[LatentAttention]:
        if not hf.get("kv_lora_rank"):
            return None
        return cls(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                   qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                   v_head_dim=hf["v_head_dim"])


@dataclass(frozen=True)
class ModelShape:
    """The sizes activations are made of, from a config.json (with the moe section's overrides)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # the shared experts' width, all of them together
    dense_layers: tuple[int, ...] = ()  # the layers of an MoE model that keep a dense MLP (of width ffn)
    latent: Optional[LatentAttention] = None  # multi-head latent attention instead of GQA
    rotary_dim: int = 0  # the rotated dimensions of each head without MLA (0: head_dim; partial_rotary_factor)
    windowed: tuple[int, ...] = ()  # the layers whose attention a sliding window limits (Mistral, gpt-oss)
    sinks: bool = False  # attention sinks (gpt-oss)
    shared_gate: bool = False  # the shared experts' output scaled by a sigmoid gate (Qwen2-MoE)
    clamped_glu: bool = False  # the experts' clamped SwiGLU, x * sigmoid(a x) * (up + 1) (gpt-oss)

    @classmethod
    def of(cls, hf: dict) -> ModelShape:
        family, heads = family_of(hf), hf["num_attention_heads"]
        experts = family.experts(hf)
        moe, routes = family.moe, family.moe.sparse_layers(hf) if experts else []
        latent = LatentAttention.of(hf) if family.mla else None
        # Not family.window(), which refuses Qwen2's use_sliding_window: the plan describes before pre-flight refuses.
        window = bool(hf.get("sliding_window")) and (family.sliding_window or family.layer_types)
        limited = family.window_layers(hf) if window else None  # None: every layer
        windowed = tuple(i for i in range(hf["num_hidden_layers"]) if limited is None or limited[i]) if window else ()
        partial = partial_rotary_factor(hf)  # GLM-4.5 rotates half of each head
        return cls(hidden=hf["hidden_size"], ffn=hf.get("intermediate_size", 0), heads=heads,
                   kv_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=head_dim(hf), layers=hf["num_hidden_layers"],
                   vocab=hf["vocab_size"], qk_norm=family.qk_norm(hf), experts=experts,
                   top_k=hf["num_experts_per_tok"] if experts else 0,
                   expert_ffn=hf[moe.width_key] if experts else 0,
                   shared_ffn=moe.shared.width(hf) if experts and moe.shared else 0,
                   dense_layers=tuple(i for i, routed in enumerate(routes) if not routed), latent=latent,
                   rotary_dim=int(head_dim(hf) * partial) if partial != 1 and not latent else 0,
                   windowed=windowed, sinks=family.sinks, clamped_glu=family.clamped_swiglu,
                   shared_gate=bool(experts and moe.shared and moe.shared.gate))

    @property
    def rotated(self) -> int:
        """The dimensions RoPE rotates in each query and key head."""
        return self.latent.qk_rope_head_dim if self.latent else self.rotary_dim or self.head_dim

    def routes(self, layer: int) -> bool:
        """Whether `layer`'s MLP routes over experts."""
        return bool(self.experts) and layer not in self.dense_layers
