"""DeepSeek-V2 (V2-Lite), DeepSeek-V3 and Moonlight (a deepseek_v3 model): multi-head latent attention
(models/mla.py); the first first_k_dense_replace layers keep a dense MLP, the others route over
n_routed_experts experts plus n_shared_experts shared ones (one MLP, no gate). V2 scores experts by softmax, V3 by
sigmoid with a per-expert bias chosen on (aux-loss-free balancing) and weights renormalised over the top-k; both
scale the weights by routed_scaling_factor and may limit each token to topk_group of n_group expert groups.
DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers, stored as extra layers after the last) are
not part of the model here: loading reads only the decoder's layers and exporting writes none."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec, SharedExperts, first_k_dense_layers
from rl_megatron.models.weight_tables import ExpertNames

EXPERTS = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
SHARED = SharedExperts(module="shared_experts", width_key="moe_intermediate_size", count_key="n_shared_experts")

V2 = register(ModelFamily(
    "deepseek_v2", qk_layernorm=False, qkv_bias_key=None, mla=True,
    moe=MoeSpec(EXPERTS, width_key="moe_intermediate_size", renormalises_top_k=False,
                sparse_layers=first_k_dense_layers, shared=SHARED)))
V3 = register(ModelFamily(
    "deepseek_v3", qk_layernorm=False, qkv_bias_key=None, mla=True,
    moe=MoeSpec(EXPERTS, width_key="moe_intermediate_size", renormalises_top_k=True,
                sparse_layers=first_k_dense_layers, shared=SHARED, score_function="sigmoid", expert_bias=True)))
