"""The moe section and the expert layout: loading, what each knob turns into in Megatron's TransformerConfig, and
every validation message (naming the key and the fix). No processes, no Megatron state: well under a second each."""
import json
import os

import pytest
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.models.hf_config import model_config, moe_hf_overrides
from rl_megatron.preflight import load_config
from rl_megatron.config.schema import MoeConfig
from rl_megatron.models.gpt import moe_settings, transformer_config

BASE = os.path.join(REPO, "configs", "moe", "grpo_tiny_qwen3_moe_cpu.yaml")
MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen3-moe-digits")


def load(*overrides, model=MODEL):
    return load_config(BASE, [f"model.path={model}", *overrides])


def error(*overrides, model=MODEL) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, model=model)
    return str(info.value)


def model_with(tmp_path, **fields) -> str:
    """The tiny MoE model's folder with config.json fields changed."""
    with open(os.path.join(MODEL, "config.json")) as f:
        config = {**json.load(f), **fields}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_defaults_keep_the_router_objective_free_and_drop_nothing():
    cfg = load()
    assert cfg.moe == MoeConfig() and cfg.actor.expert_model_parallel_size == 2
    settings = moe_settings(model_config(cfg), cfg.moe)
    assert settings["num_moe_experts"] == 4 and settings["moe_router_topk"] == 2
    assert settings["moe_router_load_balancing_type"] == "none" and settings["moe_aux_loss_coeff"] == 0.0
    assert settings["moe_z_loss_coeff"] is None and settings["moe_expert_capacity_factor"] is None
    assert settings["moe_router_dtype"] is None and settings["moe_grouped_gemm"] is False
    assert settings["moe_token_dispatcher_type"] == "allgather"  # on the CPU


def test_each_knob_reaches_megatron():
    cfg = load("moe.num_experts=8", "moe.top_k=3", "moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=0.001",
               "moe.capacity_factor=1.25", "moe.token_drop_policy=position", "moe.router_dtype=fp64",
               "moe.token_dispatcher=allgather")
    hf = model_config(cfg)
    # transformers >= 5 writes num_local_experts: the override replaces the key the folder has, for vLLM too.
    assert moe_hf_overrides(cfg, hf) == {"num_local_experts": 8, "num_experts_per_tok": 3}
    deepseek = {"model_type": "deepseek_v3", "n_routed_experts": 4}  # DeepSeek's and GLM's key
    assert moe_hf_overrides(cfg, deepseek) == {"n_routed_experts": 8, "num_experts_per_tok": 3}
    config = transformer_config(hf, tp=1, pp=1, dtype="float32", ep=2, etp=1, moe=cfg.moe)
    assert (config.num_moe_experts, config.moe_router_topk) == (8, 3)
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff == 0.01
    assert config.moe_z_loss_coeff == 0.001 and config.moe_expert_capacity_factor == 1.25
    assert config.moe_token_drop_policy == "position" and config.moe_router_dtype == "fp64"
    assert config.expert_tensor_parallel_size == 1


def test_alltoall_dispatcher_is_refused_on_the_cpu():
    cfg = load("moe.token_dispatcher=alltoall")  # valid: it runs on GPU machines
    with pytest.raises(ValueError, match="moe.token_dispatcher=alltoall needs CUDA.*allgather"):
        moe_settings(model_config(cfg), cfg.moe)


def test_grouped_gemm_is_refused_without_transformer_engine_layers():
    cfg = load("moe.grouped_gemm=true")  # valid: GPU machines with TE build TEGroupedMLP
    with pytest.raises(ValueError, match="moe.grouped_gemm=true needs Transformer Engine.*moe.grouped_gemm=false"):
        moe_settings(model_config(cfg), cfg.moe)
    assert moe_settings(model_config(load()), load().moe)["moe_grouped_gemm"] is False


@pytest.mark.parametrize("key", ["moe.num_experts=8", "moe.top_k=1"])
def test_shape_overrides_need_random_init(key):
    message = error(key, "model.random_init=false")
    assert key in message and "model.random_init=true" in message


@pytest.mark.parametrize("override, key, fix", [
    ("moe.num_experts=0", "moe.num_experts=0", "at least 1"),
    ("moe.top_k=5", "num_experts_per_tok=5", "moe.top_k"),
    ("moe.num_experts=5", "actor.expert_model_parallel_size=2", "5 experts"),  # EP=2 must divide them
    ("moe.top_k=1", "moe.top_k >= 2", "norm_topk_prob"),  # Megatron: top-1 needs un-renormalised weights
    ("moe.aux_loss_coeff=-0.1", "moe.aux_loss_coeff=-0.1", "0 turns it off"),
    ("moe.z_loss_coeff=-1", "moe.z_loss_coeff=-1", "0 turns it off"),
    ("moe.capacity_factor=0", "moe.capacity_factor=0", "null"),
    ("moe.token_drop_policy=random", "moe.token_drop_policy='random'", "position"),
    ("moe.token_dispatcher=flex", "moe.token_dispatcher='flex'", "allgather"),
    ("moe.router_dtype=bf16", "moe.router_dtype='bf16'", "fp64"),
    ("actor.expert_tensor_parallel_size=0", "actor.expert_tensor_parallel_size=0", "at least 1"),
])
def test_bad_knob_values_name_the_key_and_the_fix(override, key, fix):
    message = error(override)
    assert key in message and fix in message


def test_moe_knobs_on_a_dense_model_are_refused():
    message = error("moe.aux_loss_coeff=0.01", "actor.expert_model_parallel_size=1",
                    model=os.path.join(REPO, "configs", "models", "tiny-qwen2-digits"))
    assert "moe.aux_loss_coeff" in message and "dense" in message


def test_shared_experts_are_refused_not_ignored(tmp_path):
    message = error(model=model_with(tmp_path, shared_expert_intermediate_size=64))
    assert "shared_expert_intermediate_size=64" in message and "qwen3_moe family has no shared experts" in message


def test_expert_tensor_parallelism_apart_from_attention_tp():
    # Attention split over the 2 ranks, each expert whole on one of them (Megatron's "MoE parallel folding").
    cfg = load("actor.tensor_model_parallel_size=2", "actor.expert_tensor_parallel_size=1")
    assert cfg.actor.expert_tensor_parallel_size == 1 and cfg.actor.expert_model_parallel_size == 2


@pytest.mark.parametrize("overrides, words", [
    (["actor.tensor_model_parallel_size=1", "actor.expert_tensor_parallel_size=2"], ["exceeds", "1 is common"]),
    (["actor.tensor_model_parallel_size=2"], ["x actor.expert_tensor_parallel_size=2", "must divide the actor's 2"]),
    (["actor.tensor_model_parallel_size=2", "actor.expert_model_parallel_size=1", "actor.expert_tensor_parallel_size=1"],
     ["=1 x actor.expert_tensor_parallel_size=1 is below actor.tensor_model_parallel_size=2", "at least 2"]),
])
def test_expert_layout_must_fit_the_devices(overrides, words):
    message = error(*overrides)
    assert all(word in message for word in words), message


def test_expert_width_must_split_over_expert_tp(tmp_path):
    message = error("actor.tensor_model_parallel_size=2", "actor.expert_model_parallel_size=1",
                    model=model_with(tmp_path, moe_intermediate_size=63))
    assert "moe_intermediate_size=63" in message and "actor.expert_tensor_parallel_size=2" in message
