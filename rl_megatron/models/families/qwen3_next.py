"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet layers (linear attention: models/linear_attention.py)
and full-attention layers, every full_attention_interval-th one (or as layer_types lists them). Full attention is
Qwen3's (per-head q/k norms, grouped key/value heads) with an output gate that q_proj holds beside each head's query,
and rotary embeddings over the first partial_rotary_factor of each head. Every RMSNorm but the linear attention's
gated one scales by 1 + weight. A layer's MLP is Qwen2-MoE's: a softmax router (its top-k weights renormalised
unless norm_topk_prob says otherwise) beside one shared expert whose output a sigmoid gate scales; layers listed in
mlp_only_layers (or off the decoder_sparse_step) keep a dense MLP. The multi-token-prediction layers of the released
checkpoints (mtp.*) are not part of the model here: neither loaded nor exported."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec, SharedExperts, qwen_sparse_layers
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "qwen3_next", qk_layernorm=True, qkv_bias_key=None, zero_centred_norms=True, attention_output_gate=True,
    gated_delta_net=True,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=True, sparse_layers=qwen_sparse_layers,
                shared=SharedExperts(module="shared_expert", width_key="shared_expert_intermediate_size",
                                     gate="shared_expert_gate"))))
