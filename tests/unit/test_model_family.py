"""The model-family registry: one complete `ModelFamily` record per supported config.json model_type, what each
gives Megatron and the weight tables, and the message for a model_type without one."""
import pytest

from rl_megatron.config import ConfigError, check_model_layout
from rl_megatron.models.family import COMMON_FIELDS, FAMILIES, ModelFamily, family_of, register, table_for
from rl_megatron.models.weight_tables import MoeTable

DENSE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8,
         "intermediate_size": 16, "vocab_size": 10}
MOE = {**DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6}


def model(model_type: str) -> dict:
    return {**(MOE if FAMILIES[model_type].moe else DENSE), "model_type": model_type}


def test_the_supported_families_are_registered_by_model_type():
    assert sorted(FAMILIES) == ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
    assert all(family.model_type == name for name, family in FAMILIES.items())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_record_is_complete(model_type):
    family = FAMILIES[model_type]
    hf = model(model_type)
    assert set(COMMON_FIELDS) <= set(family.config_fields)
    attention = family.attention_fields(hf)
    assert set(attention) == {"add_qkv_bias", "qk_layernorm"}
    moe = family.moe_fields(hf)
    assert bool(moe) == (family.moe is not None)
    if family.moe is not None:
        assert {family.moe.width_key, "num_experts_per_tok"} <= set(family.config_fields)
        assert moe["num_moe_experts"] == 4 and moe["moe_ffn_hidden_size"] == hf[family.moe.width_key]
    table = family.weight_table(hf, padded_vocab=16)
    assert isinstance(table, MoeTable) == (family.moe is not None)
    # The table holds exactly the model's parameters: the planner counts them, loading looks them up.
    assert ("self_attention.linear_qkv.bias" in table.layer) == attention["add_qkv_bias"]
    assert ("self_attention.q_layernorm.weight" in table.layer) == attention["qk_layernorm"]
    assert set(family.checkpoint_fields(hf)) >= {"qkv_bias", "qk_layernorm", "num_experts"}
    check_model_layout(hf, ("tp", 2), ("pp", 2), ("ep", 4 if family.moe else 1))


def test_family_specific_settings():
    assert FAMILIES["qwen2"].attention_fields(model("qwen2")) == {"add_qkv_bias": True, "qk_layernorm": False}
    assert FAMILIES["llama"].attention_fields({**model("llama"), "attention_bias": True})["add_qkv_bias"]
    assert FAMILIES["qwen3"].attention_fields(model("qwen3"))["qk_layernorm"]
    assert FAMILIES["mixtral"].moe_fields(model("mixtral"))["moe_router_pre_softmax"] is False  # renormalised
    assert FAMILIES["qwen3_moe"].moe_fields(model("qwen3_moe"))["moe_router_pre_softmax"] is True


def test_an_unknown_model_type_lists_the_supported_ones():
    hf = {**DENSE, "model_type": "gpt_neox"}
    supported = "llama, mixtral, qwen2, qwen3, qwen3_moe"
    with pytest.raises(ValueError, match=f"'gpt_neox' .*supported: {supported}"):
        family_of(hf)
    with pytest.raises(ValueError, match="gpt_neox"):
        table_for(hf, 16)
    with pytest.raises(ConfigError, match=f"model_type='gpt_neox', which is not supported yet; supported: {supported}"):
        check_model_layout(hf, ("tp", 1), ("pp", 1), ("ep", 1))


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="'qwen2' is registered twice"):
        register(ModelFamily("qwen2", always_qkv_bias=True, qk_layernorm=False))
