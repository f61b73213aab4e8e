"""gpt-oss (20B, 120B): every layer routes over num_local_experts experts (no dense MLP, no shared expert) with a
biased router whose top-k logits are softmaxed (the renormalised form); the experts have biases and a clamped
SwiGLU, (up + 1) * gate * sigmoid(1.702 gate), gate clamped above and up on both sides at swiglu_limit. Attention has
q/k/v and output biases, a learned sink logit per head, YaRN rope, and a sliding window on the layers layer_types
marks (every other one, from the first). Its folders store the experts stacked (models/expert_stacks.py)."""
from rl_megatron.models.expert_stacks import StackedExpertsTable
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec
from rl_megatron.models.rotary import rope_parameters
from rl_megatron.models.weight_tables import ExpertNames

# vLLM 0.32's gpt_oss class fixes these instead of reading config.json: its swigluoai activation's alpha and limit,
# its norms' epsilon; also YaRN rope, an untied lm_head and the window on even layers (checked below).
ENGINE_CONSTANTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5}


def check_engine_constants(hf: dict) -> None:
    """ValueError naming the field where a config.json asks for what vLLM's gpt_oss model would not compute."""
    for key, value in ENGINE_CONSTANTS.items():
        if hf.get(key, value) != value:
            raise ValueError(f"{key}={hf[key]}, but vLLM's gpt_oss model computes with {key}={value} whatever "
                             f"config.json says: only {value} is supported.")
    if hf.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings=true, but vLLM's gpt_oss model keeps its own lm_head whatever config.json "
                         "says (the released models are untied): set it to false and give the folder an lm_head.")
    if rope_parameters(hf)["rope_type"] != "yarn":
        raise ValueError("gpt-oss models need YaRN rope (rope_parameters.rope_type='yarn'), the only rope vLLM's "
                         "gpt_oss model builds.")
    windowed = FAMILY.window_layers(hf)
    if windowed is not None and windowed != [i % 2 == 0 for i in range(len(windowed))]:
        raise ValueError("layer_types must alternate sliding_attention and full_attention from the first layer, "
                         "as vLLM's gpt_oss model windows every even layer whatever config.json says.")


FAMILY = register(ModelFamily(
    "gpt_oss", qk_layernorm=False, layer_types=True, sinks=True, linear_bias=True, clamped_swiglu=True,
    moe=MoeSpec(ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
                width_key="intermediate_size", renormalises_top_k=True),
    moe_table=StackedExpertsTable, engine_check=check_engine_constants))
