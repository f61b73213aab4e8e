"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases (attention_bias), per-head
q/k norms where use_qk_norm says so, and rotary embeddings over the first partial_rotary_factor of each head's
dimensions (halves rotated, not interleaved pairs); the first first_k_dense_replace layers keep a dense MLP, the
others route by sigmoid with a per-expert bias (aux-loss-free balancing, as DeepSeek-V3), weights renormalised
and scaled by routed_scaling_factor, beside n_shared_experts shared experts. The multi-token-prediction layer
stored after the last decoder layer is not part of the model here (neither loaded nor exported)."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec, SharedExperts, first_k_dense_layers
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "glm4_moe", qk_layernorm=False, qk_layernorm_key="use_qk_norm",
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=True, sparse_layers=first_k_dense_layers,
                shared=SharedExperts(module="shared_experts", width_key="moe_intermediate_size",
                                     count_key="n_shared_experts"),
                score_function="sigmoid", expert_bias=True)))
