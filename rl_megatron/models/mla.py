"""Multi-head Latent Attention (DeepSeek-V2/V3, Moonlight) as Megatron's `MLASelfAttention`: its TransformerConfig
fields from a config.json and its weight-table entries (its local core attention: models/packed_attention.py).

Queries come from a low-rank projection (q_lora_rank; none for V2-Lite and Moonlight: one q_proj), keys and values
from a compressed latent of kv_lora_rank plus one shared rotary key of qk_rope_head_dim. HF and Megatron name the
same tensors in the same row order: HF's DeepSeek rotates the rope dimensions as interleaved pairs (its default
`rope_interleave`), which is what Megatron's MLA rotary does, and vLLM too (Megatron-Bridge and mbridge map the
tensors one to one as well). The q/kv LoRA norms are Megatron's q_layernorm / kv_layernorm (`qk_layernorm=True`).
"""
from __future__ import annotations

from rl_megatron.models.rotary import rope_parameters, rope_theta
from rl_megatron.models.weight_layouts import Entry, Replicated, Split

# The config.json fields of MLA (what decides its tensors, compared when a checkpoint is loaded).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


def mla_fields(hf: dict) -> dict:
    """Megatron's MLATransformerConfig fields of a DeepSeek config.json (ValueError naming the field it cannot
    express)."""
    if hf.get("rope_interleave") is False:
        raise ValueError("rope_interleave=false (rotary dimensions split in halves) is not supported: DeepSeek's "
                         "checkpoints, Megatron's MLA and vLLM rotate interleaved pairs.")
    rope = rope_parameters(hf)
    fields = dict(multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                  qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"], kv_channels=hf["v_head_dim"], qk_layernorm=True, add_qkv_bias=False,
                  rotary_base=rope_theta(hf), rope_type="rope", rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    if rope["rope_type"] == "yarn":
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if (mscale is None) != (mscale_all_dim is None) and (mscale or 1.0) != 1.0:
            # transformers then scales cos/sin by 0.1 ln(factor) + 1; Megatron and vLLM by the ratio of defaults.
            raise ValueError("YaRN with mscale but no mscale_all_dim is not supported; set both (DeepSeek: equal).")
        original = rope["original_max_position_embeddings"]
        fields.update(rope_type="yarn", original_max_position_embeddings=original,
                      rotary_scaling_factor=rope.get("factor") or hf["max_position_embeddings"] / original,
                      beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                      mscale=mscale if mscale is not None else 1.0,
                      mscale_all_dim=mscale_all_dim if mscale_all_dim is not None else 0.0)
    elif rope["rope_type"] != "default":
        raise ValueError(f"rope_scaling type '{rope['rope_type']}' with multi-head latent attention is not "
                         "supported (yarn or none).")
    return fields


def mla_entries(hf: dict, transformer_engine: bool) -> dict[str, Entry]:
    """The weight-table entries of one MLA layer's attention (`{i}`: the layer). Up projections split over TP by
    heads, the output projection by its input; the down projections split by rows in Megatron's local layers but
    are whole on every rank in Transformer Engine's (`parallel_mode='duplicated'`)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    q_rank, kv_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
    attn = "model.layers.{i}.self_attn."
    down = Replicated() if transformer_engine else Split(dim=0)

    def entry(name, layout, shape):
        return Entry((attn + name,), layout, (shape,))

    entries = {
        "self_attention.linear_kv_down_proj.weight": entry("kv_a_proj_with_mqa.weight", down, (kv_rank + rope, hidden)),
        "self_attention.kv_layernorm.weight": entry("kv_a_layernorm.weight", Replicated(), (kv_rank,)),
        "self_attention.linear_kv_up_proj.weight": entry("kv_b_proj.weight", Split(dim=0),
                                                         (heads * (nope + v), kv_rank)),
        "self_attention.linear_proj.weight": entry("o_proj.weight", Split(dim=1), (hidden, heads * v)),
    }
    if q_rank:
        entries.update({
            "self_attention.linear_q_down_proj.weight": entry("q_a_proj.weight", down, (q_rank, hidden)),
            "self_attention.q_layernorm.weight": entry("q_a_layernorm.weight", Replicated(), (q_rank,)),
            "self_attention.linear_q_up_proj.weight": entry("q_b_proj.weight", Split(dim=0),
                                                            (heads * (nope + rope), q_rank)),
        })
    else:
        entries["self_attention.linear_q_proj.weight"] = entry("q_proj.weight", Split(dim=0),
                                                               (heads * (nope + rope), hidden))
    return entries
