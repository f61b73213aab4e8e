"""Qwen3.5's language models as their text-only folders hold them: Qwen3_5ForCausalLM (model_type qwen3_5_text, a
dense MLP on every layer) and Qwen3_5MoeForCausalLM (qwen3_5_moe_text). Both are Qwen3-Next's hybrid
(models/families/qwen3_next.py: Gated DeltaNet layers between gated full-attention ones, zero-centred norms, partial
rotary embeddings), with three differences:

- the linear attention's input projection is stored as four tensors, each part whole (in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a), not grouped per key head in two (models/linear_attention.py: QWEN3_5_IN_PROJ);
- rotary embeddings are multimodal (mrope_section in rope_parameters), but a text sequence gives the temporal,
  height and width streams the same positions, where they are plain rotary embeddings: what is computed here;
- every layer of the MoE model routes (transformers reads neither mlp_only_layers nor decoder_sparse_step) and
  always renormalises its top-k weights; its config.json has no intermediate_size.

The released multimodal folders (Qwen3_5ForConditionalGeneration, model_type qwen3_5 / qwen3_5_moe: a vision tower, the
text model under model.language_model.) are trained as their language model's text-only folder, taken out and put
back by `models/multimodal.py`; the multi-token-prediction layers (mtp.*) are not read here."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.linear_attention import QWEN3_5_IN_PROJ
from rl_megatron.models.moe import MoeSpec, SharedExperts
from rl_megatron.models.weight_tables import ExpertNames

HYBRID = dict(qk_layernorm=True, qkv_bias_key=None, zero_centred_norms=True, attention_output_gate=True,
              gated_delta_net=True, in_proj_packing=QWEN3_5_IN_PROJ)

DENSE = register(ModelFamily("qwen3_5_text", **HYBRID))
MOE = register(ModelFamily(
    "qwen3_5_moe_text", **HYBRID,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="moe_intermediate_size", renormalises_top_k=True,
                shared=SharedExperts(module="shared_expert", width_key="shared_expert_intermediate_size",
                                     gate="shared_expert_gate"))))
