"""How each MoE family's config.json becomes Megatron's router and layer settings (models/moe.py), and the configs
refused because Megatron's router would compute something else than transformers' (each checked numerically
against transformers in tests/distributed/test_moe.py where it is supported)."""
import pytest

from rl_megatron.config import ConfigError
from rl_megatron.models.checks import check_model_layout
from rl_megatron.models.family import FAMILIES
from rl_megatron.models.moe import first_k_dense_layers, qwen_sparse_layers

BASE = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 8,
        "intermediate_size": 16, "vocab_size": 10, "moe_intermediate_size": 6, "num_experts_per_tok": 2}
DEEPSEEK_V3 = {**BASE, "model_type": "deepseek_v3", "n_routed_experts": 8, "n_shared_experts": 2,
               "first_k_dense_replace": 1, "n_group": 4, "topk_group": 1, "routed_scaling_factor": 2.5,
               "norm_topk_prob": True, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
               "qk_rope_head_dim": 2, "v_head_dim": 2}


def fields(hf: dict) -> dict:
    return FAMILIES[hf["model_type"]].moe_fields(hf)


def test_deepseek_v3_sigmoid_router_with_bias_groups_scaling_shared_experts_and_a_dense_first_layer():
    got = fields(DEEPSEEK_V3)
    assert got["moe_router_score_function"] == "sigmoid" and got["moe_router_enable_expert_bias"]
    assert got["moe_router_num_groups"] == 4 and got["moe_router_group_topk"] == 1
    assert got["moe_router_topk_scaling_factor"] == 2.5
    assert got["moe_shared_expert_intermediate_size"] == 12 and not got["moe_shared_expert_gate"]
    assert got["moe_layer_freq"] == [0, 1, 1, 1] and got["num_moe_experts"] == 8


def test_deepseek_v2_softmax_router_without_renormalisation():
    v2 = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
          "routed_scaling_factor": 1.0, "topk_method": "greedy"}
    got = fields(v2)
    assert got["moe_router_score_function"] == "softmax" and got["moe_router_pre_softmax"] is True
    assert "moe_router_enable_expert_bias" not in got and "moe_router_num_groups" not in got
    assert "moe_router_topk_scaling_factor" not in got
    # config.json's scoring_func wins over the family's default.
    assert fields({**v2, "scoring_func": "sigmoid", "norm_topk_prob": True})["moe_router_score_function"] == "sigmoid"


def test_qwen2_moe_gated_shared_expert():
    qwen2_moe = {**BASE, "model_type": "qwen2_moe", "num_experts": 4, "shared_expert_intermediate_size": 10}
    got = fields(qwen2_moe)
    assert got["moe_shared_expert_intermediate_size"] == 10 and got["moe_shared_expert_gate"] is True
    assert got["moe_router_pre_softmax"] is True and "moe_layer_freq" not in got  # every layer routes


def test_which_layers_route():
    assert qwen_sparse_layers({"num_hidden_layers": 4, "mlp_only_layers": [0, 3]}) == [False, True, True, False]
    assert qwen_sparse_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == [False, True, False, True]
    assert first_k_dense_layers({"num_hidden_layers": 4, "first_k_dense_replace": 2}) == [False, False, True, True]
    assert first_k_dense_layers({"num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}) == [
        False, False, True, False]


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": False}, "sigmoid routing with norm_topk_prob=false is not supported"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 6},
     "group-limited routing with num_experts_per_tok=6, topk_group=2"),
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func='sqrtsoftplus' is not supported"),
    ({"first_k_dense_replace": 4}, "no layer routes over the experts"),
])
def test_routers_megatron_cannot_reproduce_are_refused_before_anything_starts(change, message):
    with pytest.raises(ConfigError, match=f"model.path's config.json: {message}"):
        check_model_layout({**DEEPSEEK_V3, **change}, ("tp", 1), ("pp", 1), ("ep", 1))


def test_deepseek_v2_group_limited_greedy_scores_a_group_by_its_best_expert():
    v2 = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy", "norm_topk_prob": False}
    got = fields({**v2, "n_group": 4, "topk_group": 2})  # top-2 over 2 groups: one expert per group, its best
    assert got["moe_router_num_groups"] == 4 and got["moe_router_group_topk"] == 2
    with pytest.raises(ValueError, match="topk_method='group_limited_greedy'"):
        fields({**v2, "n_group": 4, "topk_group": 1})
