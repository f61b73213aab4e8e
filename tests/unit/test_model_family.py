"""The model-family registry: one complete `ModelFamily` record per supported config.json model_type, what each
gives Megatron and the weight tables, and the message for a model_type without one."""
import math

import pytest
import torch

from rl_megatron.config import ConfigError
from rl_megatron.models.checks import check_model_layout
from rl_megatron.models.family import COMMON_FIELDS, FAMILIES, ModelFamily, family_of, register, table_for
from rl_megatron.models.weight_tables import MoeTable

DENSE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8,
         "intermediate_size": 16, "vocab_size": 10}
MOE = {**DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
MLA = {"num_key_value_heads": 4, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
       "v_head_dim": 2}
# gpt-oss's configs always say YaRN (vLLM's gpt_oss class builds nothing else).
EXTRA = {"gpt_oss": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16}, "sliding_window": 4},
         # transformers' default for the Gated DeltaNet hybrids, which config.json must state
         **{hybrid: {"partial_rotary_factor": 0.25} for hybrid in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")}}


def model(model_type: str) -> dict:
    family = FAMILIES[model_type]
    return {**(MOE if family.moe else DENSE), **(MLA if family.mla else {}), **EXTRA.get(model_type, {}),
            "model_type": model_type}


def test_the_supported_families_are_registered_by_model_type():
    assert sorted(FAMILIES) == ["deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "llama", "mistral", "mixtral", "qwen2",
                                "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
                                "qwen3_next"]
    assert all(FAMILIES[name].model_type == name for name in FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_record_is_complete(model_type):
    family = FAMILIES[model_type]
    hf = model(model_type)
    assert set(COMMON_FIELDS) <= set(family.config_fields)
    attention = family.attention_fields(hf)
    assert {"kv_channels", "add_qkv_bias", "qk_layernorm"} <= set(attention)
    assert attention.get("multi_latent_attention", False) == family.mla
    moe = family.moe_fields(hf)
    assert bool(moe) == (family.moe is not None)
    if family.moe is not None:
        assert {family.moe.width_key, "num_experts_per_tok"} <= set(family.config_fields)
        assert moe["num_moe_experts"] == 4 and moe["moe_ffn_hidden_size"] == hf[family.moe.width_key]
    table = family.weight_table(hf, padded_vocab=16)
    assert isinstance(table, MoeTable) == (family.moe is not None)
    # The table holds exactly the model's parameters: the planner counts them, loading looks them up.
    assert ("self_attention.linear_qkv.bias" in table.layer) == attention["add_qkv_bias"]
    if family.mla:  # the LoRA norms of queries (with q_lora_rank) and of the key/value latent
        assert {"self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight"} <= set(table.layer)
    else:
        assert ("self_attention.q_layernorm.weight" in table.layer) == attention["qk_layernorm"]
    assert set(family.checkpoint_fields(hf)) >= {"qkv_bias", "qk_layernorm", "num_experts"}
    check_model_layout(hf, ("tp", 2), ("pp", 2), ("ep", 4 if family.moe else 1))


def test_family_specific_settings():
    assert FAMILIES["qwen2"].attention_fields(model("qwen2")) == {"kv_channels": 2, "add_qkv_bias": True,
                                                                  "qk_layernorm": False}
    assert FAMILIES["llama"].attention_fields({**model("llama"), "attention_bias": True})["add_qkv_bias"]
    assert FAMILIES["qwen3"].attention_fields(model("qwen3"))["qk_layernorm"]
    assert FAMILIES["mixtral"].moe_fields(model("mixtral"))["moe_router_pre_softmax"] is False  # renormalised
    assert FAMILIES["qwen3_moe"].moe_fields(model("qwen3_moe"))["moe_router_pre_softmax"] is True


def test_an_unknown_model_type_lists_the_supported_ones():
    hf = {**DENSE, "model_type": "gpt_neox"}
    supported = ("deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, "
                 "qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next")
    with pytest.raises(ValueError, match=f"model_type='gpt_neox' is not a registered model family .*: {supported}"):
        family_of(hf)
    with pytest.raises(ValueError, match="gpt_neox"):
        table_for(hf, 16)
    with pytest.raises(ConfigError, match=rf"config.json: model_type='gpt_neox' is not a .*{supported}\). .*register"):
        check_model_layout(hf, ("tp", 1), ("pp", 1), ("ep", 1))


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="'qwen2' is registered twice"):
        register(ModelFamily("qwen2", qk_layernorm=False))


def test_sliding_window_mistral_only_and_refused_where_qwen2_layers_it():
    from rl_megatron.checkpoint.model import config_fields
    from rl_megatron.models.gpt import position_fields
    from rl_megatron.models.packed_attention import causal

    mistral = {**model("mistral"), "sliding_window": 3}
    assert position_fields(mistral)["window_size"] == (2, 0)
    assert config_fields(mistral)["sliding_window"] == 3
    # Qwen2's config.json carries a sliding_window that only use_sliding_window turns on.
    qwen2 = {**model("qwen2"), "sliding_window": 4096, "use_sliding_window": False}
    assert "window_size" not in position_fields(qwen2) and "sliding_window" not in config_fields(qwen2)
    with pytest.raises(ConfigError, match="model.path's config.json: use_sliding_window=true .* not supported"):
        check_model_layout({**qwen2, "use_sliding_window": True}, ("tp", 1), ("pp", 1), ("ep", 1))
    # Each position sees itself and the two before it.
    assert causal(4, (2, 0), "cpu")["attn_mask"].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0],
                                                                    [0, 1, 1, 1]]


def test_rope_scaling_is_checked_before_anything_is_built_and_recorded_in_checkpoints():
    from rl_megatron.checkpoint.model import config_fields
    from rl_megatron.models.gpt import position_fields

    with pytest.raises(ConfigError, match="model.path's config.json: rope_scaling type 'dynamic' is not supported"):
        check_model_layout({**model("llama"), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                           ("tp", 1), ("pp", 1), ("ep", 1))
    yarn = {**model("qwen2"), "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}
    assert config_fields(yarn)["rope_scaling"]["rope_type"] == "yarn"
    assert "rope_scaling" not in config_fields(model("qwen2"))
    # YaRN's cos/sin factor m enters as the softmax scale m^2 / sqrt(head_dim) (head_dim 8 / 4 = 2 here).
    assert position_fields(yarn)["softmax_scale"] == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / 2 ** 0.5)


def test_latent_attention_fields_and_its_refusals():
    from rl_megatron.models.mla import mla_fields

    deepseek = {**model("deepseek_v3"), "max_position_embeddings": 64,
                "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4,
                                 "mscale": 0.707, "mscale_all_dim": 0.707}}
    got = mla_fields(deepseek)
    assert got["q_lora_rank"] == 6 and got["kv_lora_rank"] == 4 and got["kv_channels"] == 2  # the value heads
    assert got["rope_type"] == "yarn" and got["rotary_scaling_factor"] == 40.0 and got["mscale_all_dim"] == 0.707
    plain = mla_fields(model("deepseek_v3"))
    assert plain["rope_type"] == "rope" and plain["mscale_all_dim"] == 0.0  # no YaRN softmax scaling
    for change, message in (({"rope_interleave": False}, "rope_interleave=false"),
                            ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                               "mscale": 0.5}}, "mscale but no mscale_all_dim"),
                            ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "type 'linear' with multi-head")):
        with pytest.raises(ConfigError, match=message):
            check_model_layout({**deepseek, **change}, ("tp", 1), ("pp", 1), ("ep", 1))


def test_glm_reads_its_q_k_norm_switch():
    glm = FAMILIES["glm4_moe"]
    assert glm.qk_norm({**model("glm4_moe"), "use_qk_norm": True})
    assert not glm.qk_norm(model("glm4_moe"))  # GLM-4.5-Air
    assert glm.qkv_bias({**model("glm4_moe"), "attention_bias": True})


def test_gpt_oss_record():
    """Sinks, biases everywhere, the clamped SwiGLU as Megatron's quick_gelu GLU, the window on every other layer;
    what vLLM's gpt_oss class fixes is refused otherwise, naming the field."""
    family, hf = FAMILIES["gpt_oss"], model("gpt_oss")
    assert family.attention_fields(hf)["softmax_type"] == "learnable"
    assert family.mlp_fields(hf) == {"activation": "quick_gelu", "add_bias_linear": True, "glu_linear_offset": 1.0,
                                     "activation_func_clamp_value": 7.0}
    assert family.window(hf) == 4 and family.window_layers(hf) == [True, False]
    assert family.checkpoint_fields(hf)["window_layers"] == [True, False]
    table = family.weight_table(hf, padded_vocab=16)
    assert {"self_attention.core_attention.softmax_offset", "mlp.router.bias", "mlp.experts.linear_fc1.bias",
            "mlp.experts.linear_fc2.bias", "self_attention.linear_proj.bias"} <= set(table.layer)
    for field, value, words in [("swiglu_limit", 5.0, "swiglu_limit=5.0"), ("rms_norm_eps", 1e-6, "rms_norm_eps"),
                                ("layer_types", ["full_attention", "sliding_attention"], "alternate"),
                                ("layer_types", ["sliding_attention"], "each of the num_hidden_layers=2"),
                                ("rope_parameters", {"rope_type": "default"}, "YaRN"),
                                ("tie_word_embeddings", True, "tie_word_embeddings=true")]:
        with pytest.raises(ConfigError, match=words):
            family.check({**hf, field: value}, "config.json")


def test_gpt_oss_folders_store_the_experts_stacked():
    """Per-expert tensors <-> the stacked, input-major, gate/up-interleaved tensors of gpt-oss's folders."""
    hf = model("gpt_oss")
    table = FAMILIES["gpt_oss"].weight_table(hf, padded_vocab=16)
    g = torch.Generator().manual_seed(0)
    needed = table.hf_tensors()
    state = {name: torch.randn(shape, generator=g) for name, shape in needed.items()}
    stored = table.stored_tensors(state)
    assert {name: tuple(t.shape) for name, t in stored.items()} == table.stored_shapes(needed)
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 8, 32)  # [experts, hidden, 2 x width]
    assert torch.equal(gate_up[2, :, 0::2], state["model.layers.1.mlp.experts.2.gate_proj.weight"].t())
    assert torch.equal(gate_up[2, :, 1::2], state["model.layers.1.mlp.experts.2.up_proj.weight"].t())
    read = table.stored_reader(lambda name, expert=None: stored[name] if expert is None else stored[name][expert])
    assert all(torch.equal(read(name), tensor) for name, tensor in state.items())
