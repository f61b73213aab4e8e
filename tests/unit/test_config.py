"""Config loading: YAML + `key=value` overrides onto the typed schema, and the validation messages.

Every failure must be a ConfigError whose message names the offending key (and says how to fix it).
No Ray, no Megatron: these run in well under a second.
"""
import json
import os
import shutil

import pytest
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.config.schema import ActorConfig, Config, OptimConfig, TrainerConfig

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")


def load_demo(*overrides):
    """The demo config, with its (repo-relative) model path made absolute so the tests run from any folder."""
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


def config_error(*overrides, path=DEMO) -> str:
    """The message of the ConfigError that loading `path` with `overrides` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, [f"model.path={DEMO_MODEL}", *overrides] if path == DEMO else list(overrides))
    return str(info.value)


def write(folder, name, text) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def model_folder(folder, **hf) -> str:
    """A model folder whose config.json has the demo model's shape, changed by `hf` (None drops a field), with the
    demo model's tokenizer (and, like it, no weights: for random_init configs)."""
    config = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "hidden_size": 64, "vocab_size": 18, "eos_token_id": 2, **hf}
    config = {key: value for key, value in config.items() if value is not None}
    os.makedirs(folder, exist_ok=True)
    write(folder, "config.json", json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_MODEL, name), folder)
    return str(folder)


# ----------------------------------------------------------------------------------------------- loading


def test_demo_config_loads_as_typed_dataclasses():
    cfg = load_demo()
    assert isinstance(cfg, Config)
    assert isinstance(cfg.trainer, TrainerConfig)
    assert isinstance(cfg.actor, ActorConfig)
    assert isinstance(cfg.actor.optim, OptimConfig)
    assert isinstance(cfg.actor.optim.lr, float) and cfg.actor.optim.lr == pytest.approx(1e-3)
    assert cfg.actor.optim.betas == (0.9, 0.999)
    assert cfg.trainer.experiment_name == "demo_cpu"
    assert isinstance(cfg.trainer.total_steps, int) and cfg.trainer.total_steps == 400
    assert cfg.actor.tensor_model_parallel_size == 2
    assert cfg.model.random_init is True
    assert cfg.trainer.target_reward == pytest.approx(0.8)


def test_demo_config_loads_with_its_relative_model_path_from_the_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("configs/demo_cpu.yaml")
    assert cfg.model.path == "configs/models/tiny-qwen2-digits"


def test_schema_defaults_fill_keys_the_yaml_leaves_out():
    cfg = load_demo()
    assert cfg.trainer.seed == 0
    assert cfg.actor.optim.lr_decay_style == "constant"
    assert cfg.ray.address is None


def test_overrides_apply_to_nested_keys_and_are_typed(tiny_model_dir):
    cfg = load_demo("actor.optim.lr=0.5", "trainer.total_steps=5", "trainer.target_reward=null",
                    f"model.path={tiny_model_dir}", "model.random_init=false", "actor.optim.betas=[0.8,0.95]", "trainer.experiment_name=123")
    assert cfg.actor.optim.lr == 0.5 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.trainer.total_steps == 5 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.trainer.target_reward is None
    assert cfg.model.random_init is False
    assert cfg.actor.optim.betas == (0.8, 0.95)
    assert cfg.trainer.experiment_name == "123"  # a str field keeps a number-looking value as a str
    assert cfg.actor.optim.clip_grad == 1.0  # the YAML's sibling keys survive a nested override


def test_scientific_notation_and_int_to_float_overrides():
    assert load_demo("actor.optim.lr=1e-4").actor.optim.lr == pytest.approx(1e-4)
    cfg = load_demo("trainer.target_reward=1")
    assert cfg.trainer.target_reward == 1.0 and isinstance(cfg.trainer.target_reward, float)


def test_later_overrides_win():
    assert load_demo("trainer.total_steps=5", "trainer.total_steps=7").trainer.total_steps == 7


def test_override_value_may_contain_equals_sign():
    assert load_demo("trainer.experiment_name=a=b").trainer.experiment_name == "a=b"


def test_yaml_boolean_words_stay_text_for_text_keys(tmp_path):
    """YAML 1.1 reads unquoted off/on/yes/no as booleans: an override of a text key keeps the word as typed (the
    docs' `trainer.resume=off`), and a YAML file's unquoted one is refused, naming the key and the quoting fix."""
    assert load_demo("trainer.resume=off").trainer.resume == "off"
    assert load_demo("trainer.experiment_name=yes").trainer.experiment_name == "yes"
    assert load_demo("trainer.progress_bar=off").trainer.progress_bar is False  # a bool key still reads a bool
    path = write(tmp_path, "c.yaml", f"trainer:\n  resume: off\nmodel:\n  path: {DEMO_MODEL}\n")
    message = config_error(path=path)
    assert "'trainer.resume'" in message and "boolean False" in message and "resume: 'off'" in message
    quoted = f"trainer:\n  resume: 'off'\nmodel:\n  path: {DEMO_MODEL}\n  random_init: true\n"
    assert load_config(write(tmp_path, "d.yaml", quoted), []).trainer.resume == "off"


def test_no_yaml_at_all_uses_the_schema_defaults_plus_overrides():
    cfg = load_config(None, [f"model.path={DEMO_MODEL}", "model.random_init=true"])  # the demo model has no weights
    assert cfg.actor.optim.lr == 1e-6 and cfg.trainer.total_steps == 100


def test_an_empty_section_in_yaml_is_allowed(tmp_path):
    path = write(tmp_path, "c.yaml", f"trainer:\nmodel:\n  path: {DEMO_MODEL}\n  random_init: true\n")
    assert load_config(path).trainer.total_steps == 100


# ------------------------------------------------------------------------------------- files and syntax


def test_missing_yaml_file(tmp_path):
    message = config_error(path=str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in message and "does not exist" in message


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "trainer:\n  total_steps: [1, 2\nmodel:\n  path: x\n")
    message = config_error(path=path)
    assert "bad.yaml" in message and "not valid YAML" in message and "line" in message
    assert "\n" not in message


def test_yaml_that_is_a_list_is_rejected(tmp_path):
    path = write(tmp_path, "list.yaml", "- trainer\n- model\n")
    message = config_error(path=path)
    assert "list.yaml" in message and "mapping" in message


def test_unknown_key_in_yaml_suggests_the_close_match(tmp_path):
    path = write(tmp_path, "typo.yaml", f"trainer:\n  total_step: 5\nmodel:\n  path: {DEMO_MODEL}\n")
    message = config_error(path=path)
    assert "'trainer.total_step'" in message and "typo.yaml" in message
    assert "Did you mean 'trainer.total_steps'?" in message


def test_unknown_section_in_yaml(tmp_path):
    path = write(tmp_path, "typo.yaml", "trainerr:\n  total_steps: 5\n")
    message = config_error(path=path)
    assert "'trainerr'" in message and "Did you mean 'trainer'?" in message


def test_unknown_key_in_overrides_suggests_the_close_match():
    message = config_error("trainer.total_step=5")
    assert "'trainer.total_step'" in message and "command-line" in message
    assert "Did you mean 'trainer.total_steps'?" in message


def test_unknown_key_with_no_close_match_points_at_the_schema():
    message = config_error("zzz.qqq=1")
    assert "'zzz.qqq'" in message and "schema.py" in message


def test_override_without_equals_sign():
    message = config_error("trainer.total_steps")
    assert "'trainer.total_steps'" in message and "key=value" in message


def test_override_without_a_key():
    message = config_error("=5")
    assert "'=5'" in message and "no key" in message


def test_override_with_unparsable_value():
    message = config_error("trainer.experiment_name=[a")
    assert "trainer.experiment_name" in message and "not valid YAML" in message


def test_a_section_given_a_plain_value():
    message = config_error("actor.optim=3")
    assert "'actor.optim'" in message and "section" in message and "actor.optim.<key>" in message


def test_a_value_given_a_mapping(tmp_path):
    path = write(tmp_path, "c.yaml", f"trainer:\n  total_steps:\n    a: 1\nmodel:\n  path: {DEMO_MODEL}\n")
    message = config_error(path=path)
    assert "'trainer.total_steps'" in message and "single value" in message


# -------------------------------------------------------------------------------------------------- types


@pytest.mark.parametrize("override, key", [
    ("trainer.total_steps=abc", "trainer.total_steps"),
    ("trainer.total_steps=1.5", "trainer.total_steps"),
    ("trainer.progress_bar=maybe", "trainer.progress_bar"),
    ("actor.optim.lr=fast", "actor.optim.lr"),
    ("actor.optim.betas=[0.9]", "actor.optim.betas"),
    ("trainer.experiment_name=null", "trainer.experiment_name"),
])
def test_type_errors_name_the_key(override, key):
    message = config_error(override)
    assert f"'{key}'" in message and "bad value" in message and "schema.py" in message
    assert "\n" not in message and "full_key" not in message


def test_type_error_in_yaml_names_the_key_and_file(tmp_path):
    path = write(tmp_path, "c.yaml", f"trainer:\n  total_steps: many\nmodel:\n  path: {DEMO_MODEL}\n")
    message = config_error(path=path)
    assert "'trainer.total_steps'" in message and "c.yaml" in message


def test_unresolvable_interpolation_names_the_key():
    message = config_error("trainer.total_steps=${nowhere}")
    assert "'trainer.total_steps'" in message and "nowhere" in message


# --------------------------------------------------------------------------------------------- model path


def test_yaml_without_model_path_says_it_must_be_set(tmp_path):
    path = write(tmp_path, "nomodel.yaml", "trainer:\n  total_steps: 3\n")
    message = config_error(path=path)
    assert "'model.path'" in message and "must be set" in message and "model.path=" in message


def test_model_path_that_does_not_exist(tmp_path):
    message = config_error(f"model.path={tmp_path / 'no-such-model'}")
    assert "model.path=" in message and "no-such-model" in message and "not a folder" in message


def test_model_path_without_config_json(tmp_path):
    message = config_error(f"model.path={tmp_path}")
    assert "model.path=" in message and "config.json" in message and "Hugging Face" in message


def test_model_path_with_broken_config_json(tmp_path):
    write(tmp_path, "config.json", "{not json")
    message = config_error(f"model.path={tmp_path}")
    assert "model.path=" in message and "config.json" in message and "JSON" in message


def test_model_config_json_lacking_a_required_field(tmp_path):
    write(tmp_path, "config.json", json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 8}))
    message = config_error(f"model.path={tmp_path}")
    assert "'hidden_size'" in message and "model.path" in message


# ------------------------------------------------------------------------------------ parallelism layout


@pytest.mark.parametrize("overrides", [
    ["actor.tensor_model_parallel_size=3"],  # 2 devices, TP 3
    ["actor.tensor_model_parallel_size=1", "actor.pipeline_model_parallel_size=4"],  # 2 devices, PP 4
    ["trainer.n_gpus_per_node=3"],  # 3 devices, TP 2
    ["trainer.nnodes=3", "trainer.n_gpus_per_node=1"],  # 3 devices, TP 2
])
def test_tp_pp_cp_must_divide_the_devices(overrides):
    message = config_error(*overrides)
    assert "actor.tensor_model_parallel_size" in message and "actor.pipeline_model_parallel_size" in message
    assert "trainer.nnodes" in message and "trainer.n_gpus_per_node" in message
    assert "divide" in message


def test_context_parallel_needs_sequence_packing():
    message = config_error("trainer.n_gpus_per_node=4", "actor.context_parallel_size=2", "actor.sequence_packing=false")
    assert "actor.context_parallel_size=2" in message and "actor.sequence_packing=true" in message
    assert "actor.context_parallel_size=1" in message  # the other way out


def test_context_parallel_with_packing_takes_its_share_of_the_devices():
    """CP ranks come out of data parallelism: 8 devices at TP 2 x CP 2 leave DP 2, so a mini-batch of 16 x 8 samples
    splits into DP 2 x micro-batches of 64 but not of 48 (for the colocated reference and critic too, which counted
    DP 4 here before); and TP x PP x CP must divide the devices."""
    cfg = load_demo("trainer.n_gpus_per_node=8", "actor.context_parallel_size=2")
    assert cfg.actor.context_parallel_size == 2 and cfg.actor.sequence_packing
    message = config_error("trainer.n_gpus_per_node=8", "actor.context_parallel_size=2", "actor.micro_batch_size=48")
    assert "data-parallel size 2 x actor.micro_batch_size=48" in message
    message = config_error("trainer.n_gpus_per_node=6", "actor.context_parallel_size=2", "rollout.n=6")
    assert "actor.context_parallel_size=2 = 4 does not divide" in message


def test_tp_must_divide_the_attention_heads(tmp_path):
    model = model_folder(tmp_path / "m", num_attention_heads=3, num_key_value_heads=3)
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=2")
    assert "actor.tensor_model_parallel_size=2" in message and "attention heads (3)" in message


def test_tp_must_divide_the_key_value_heads(tmp_path):
    model = model_folder(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3)
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=2")
    assert "actor.tensor_model_parallel_size=2" in message and "key/value heads (3)" in message


def test_tp_dividing_both_head_counts_is_fine(tmp_path):
    # head_dim 32: the width 64 / 6 heads would leave vLLM's CPU attention no kernel (rollout/vllm_cpu_attention.py)
    model = model_folder(tmp_path / "m", num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    assert load_demo(f"model.path={model}").actor.tensor_model_parallel_size == 2


def test_missing_key_value_heads_means_as_many_as_attention_heads(tmp_path):
    model = model_folder(tmp_path / "m", num_attention_heads=3, num_key_value_heads=None)
    message = config_error(f"model.path={model}")
    assert "attention heads (3) and key/value heads (3)" in message


def test_rollout_tp_must_divide_the_heads_too(tmp_path):
    model = model_folder(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3)
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                           "rollout.tensor_parallel_size=2")
    assert "rollout.tensor_parallel_size=2" in message and "key/value heads (3)" in message


def test_rollout_tp_must_divide_the_devices():
    message = config_error("rollout.tensor_parallel_size=4")
    assert "rollout.tensor_parallel_size=4" in message and "devices" in message


def test_pp_must_divide_the_layers(tmp_path):
    model = model_folder(tmp_path / "m", num_hidden_layers=3)
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                           "actor.pipeline_model_parallel_size=2")
    assert "actor.pipeline_model_parallel_size=2" in message and "3 layers" in message


def test_virtual_pipeline_needs_pipeline_stages():
    message = config_error("actor.virtual_pipeline_model_parallel_size=2")
    assert "actor.virtual_pipeline_model_parallel_size=2" in message and "actor.pipeline_model_parallel_size" in message


def test_pp_times_vpp_must_divide_the_layers(tmp_path):
    model = model_folder(tmp_path / "m", num_hidden_layers=6)  # PP 2 divides 6, PP 2 x VPP 2 does not
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                           "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2")
    assert "actor.pipeline_model_parallel_size=2" in message and "6 layers" in message
    assert "actor.virtual_pipeline_model_parallel_size=2" in message


def test_interleaved_schedule_needs_micro_batches_in_multiples_of_pp(tmp_path):
    # 2 devices at TP 1, PP 2 -> DP 1; a mini-batch of 16 x 8 = 128 samples is a single micro-batch of 128.
    model = model_folder(tmp_path / "m", num_hidden_layers=4)
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                           "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2",
                           "actor.micro_batch_size=128")
    assert "actor.virtual_pipeline_model_parallel_size=2" in message and "actor.micro_batch_size=128" in message
    assert "= 1)" in message and "multiple of actor.pipeline_model_parallel_size=2" in message


def test_interleaved_pipeline_layout_loads(tmp_path):
    model = model_folder(tmp_path / "m", num_hidden_layers=4)
    cfg = load_demo(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                    "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2")
    assert cfg.actor.virtual_pipeline_model_parallel_size == 2


def moe_folder(folder, **hf) -> str:
    return model_folder(folder, **{"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, **hf})


def test_expert_parallelism_needs_an_moe_model():
    message = config_error("actor.tensor_model_parallel_size=1", "actor.expert_model_parallel_size=2")
    assert "actor.expert_model_parallel_size=2" in message and "MoE" in message and "model_type='qwen2'" in message


def test_expert_parallelism_must_divide_the_data_parallel_size(tmp_path):
    # The demo's 2 devices at TP 2 leave one data-parallel rank.
    message = config_error(f"model.path={moe_folder(tmp_path / 'm')}", "actor.expert_model_parallel_size=2")
    assert "actor.expert_model_parallel_size=2" in message and "data-parallel size 1" in message


def test_expert_parallelism_must_divide_the_experts(tmp_path):
    message = config_error(f"model.path={moe_folder(tmp_path / 'm', num_experts=3)}",
                           "actor.tensor_model_parallel_size=1", "actor.expert_model_parallel_size=2")
    assert "actor.expert_model_parallel_size=2" in message and "3 experts" in message


def test_router_replay_needs_an_moe_model_and_r3_the_engines_routing(tmp_path):
    message = config_error("actor.router_replay=R2")
    assert "actor.router_replay=R2" in message and "model_type='qwen2'" in message and "disabled" in message
    moe = f"model.path={moe_folder(tmp_path / 'm')}"
    for mode in ("R2", "R3"):
        assert load_demo(moe, f"actor.router_replay={mode}", "actor.tensor_model_parallel_size=1",
                         "actor.pipeline_model_parallel_size=2").actor.router_replay == mode
    cfg = load_demo(moe, "actor.router_replay=R2", "actor.tensor_model_parallel_size=1",
                    "actor.expert_model_parallel_size=2")
    assert cfg.actor.router_replay == "R2"
    message = config_error(moe, "actor.router_replay=R3", "moe.engine_routing=false")
    assert "moe.engine_routing=false" in message and "actor.router_replay=R2" in message
    assert load_demo(moe, "actor.router_replay=R3", "actor.tensor_model_parallel_size=1").actor.router_replay == "R3"
    message = config_error("moe.engine_routing=true")  # the demo's model is dense
    assert "moe.engine_routing" in message and "dense" in message


def test_moe_models_with_dense_layers_load_unless_no_layer_routes(tmp_path):
    assert load_demo(f"model.path={moe_folder(tmp_path / 'm', mlp_only_layers=[1])}").model.path
    message = config_error(f"model.path={moe_folder(tmp_path / 'd', mlp_only_layers=[0, 1])}")
    assert "no layer routes over the experts" in message and "model.path" in message


def test_expert_parallel_layout_loads_with_either_experts_key(tmp_path):
    # transformers >= 5 writes num_local_experts where Qwen's own configs say num_experts.
    model = moe_folder(tmp_path / "m", num_experts=None, num_local_experts=4)
    cfg = load_demo(f"model.path={model}", "actor.tensor_model_parallel_size=1", "actor.expert_model_parallel_size=2")
    assert cfg.actor.expert_model_parallel_size == 2


# ------------------------------------------------------------------------------------------- batch sizes


def test_train_batch_must_be_a_multiple_of_the_mini_batch():
    message = config_error("data.train_batch_size=24")
    assert "data.train_batch_size=24" in message and "actor.ppo_mini_batch_size=16" in message
    assert "multiple" in message


def test_mini_batch_samples_must_split_into_dp_micro_batches():
    # 2 devices at TP 1 -> DP 2; a mini-batch of 16 x 8 = 128 samples does not split into 2 x 48.
    message = config_error("actor.tensor_model_parallel_size=1", "actor.micro_batch_size=48")
    assert "actor.ppo_mini_batch_size" in message and "rollout.n" in message
    assert "actor.micro_batch_size=48" in message and "data-parallel size 2" in message


def test_batch_that_does_not_split_over_the_rollout_engines():
    # 2 engines, train batch 3 x 1 sample: 3 samples do not split over 2 engines.
    message = config_error("data.train_batch_size=3", "actor.ppo_mini_batch_size=1", "rollout.n=1",
                           "actor.micro_batch_size=1")
    assert "data.train_batch_size" in message and "rollout.n" in message and "rollout engines" in message


def test_prompt_plus_response_must_fit_the_model_length():
    message = config_error("rollout.max_tokens=100", "rollout.max_model_len=32")
    assert "rollout.max_tokens" in message and "rollout.max_model_len=32" in message


def test_derived_model_length_beyond_the_model_positions():
    message = config_error("rollout.max_tokens=600")
    assert "data.max_prompt_length + rollout.max_tokens = 608" in message and "max_position_embeddings" in message


# ------------------------------------------------------------------------------------- values and names


@pytest.mark.parametrize("key", [
    "trainer.total_steps", "trainer.nnodes", "trainer.n_gpus_per_node", "actor.tensor_model_parallel_size",
    "actor.pipeline_model_parallel_size", "actor.virtual_pipeline_model_parallel_size",
    "actor.expert_model_parallel_size", "actor.ppo_mini_batch_size",
    "actor.ppo_epochs",
    "actor.micro_batch_size", "rollout.n", "rollout.max_tokens", "rollout.tensor_parallel_size",
    "data.train_batch_size", "data.max_prompt_length", "model.make_vocab_size_divisible_by", "ray.num_cpus",
])
@pytest.mark.parametrize("value", [0, -1])
def test_values_below_one_are_rejected(key, value):
    message = config_error(f"{key}={value}")
    assert f"{key}={value}" in message and "at least 1" in message


@pytest.mark.parametrize("override, key", [
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.top_k=0", "rollout.top_k"),
    ("rollout.gpu_memory_utilization=2", "rollout.gpu_memory_utilization"),
    ("actor.optim.lr=-0.1", "actor.optim.lr"),
    ("actor.clip_ratio_low=-0.2", "actor.clip_ratio_low"),
])
def test_out_of_range_values_are_rejected(override, key):
    assert f"{key}=" in config_error(override)


@pytest.mark.parametrize("override, key, fix", [
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator", "reinforce_plus_plus_baseline"),
    ("actor.policy_loss=grpo", "actor.policy_loss", "register_policy_loss('grpo')"),
    ("actor.loss_agg_mode=seq-mean", "actor.loss_agg_mode", "seq-mean-token-sum-norm"),
    ("critic.loss_agg_mode=mean", "critic.loss_agg_mode", "token-mean"),
    ("actor.kl_loss_type=k5", "actor.kl_loss_type", "low_var_kl"),
    ("algorithm.kl_penalty=full", "algorithm.kl_penalty", "k3"),
    ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type", "adaptive"),
    ("critic.placement=remote", "critic.placement", "separate"),
    ("model.dtype=float16", "model.dtype", "bfloat16"),
    ("actor.optim.lr_decay_style=step", "actor.optim.lr_decay_style", "cosine"),
    ("data.task=gsm8k", "data.task", "arithmetic"),
])
def test_unknown_names_are_rejected_with_the_choices(override, key, fix):
    message = config_error(override)
    assert f"{key}=" in message and "'" + override.split("=")[1] + "'" in message and fix in message


def test_unsupported_model_family_is_named(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 2, '
                                       '"hidden_size": 64, "vocab_size": 18}')
    message = config_error(f"model.path={model}")
    assert "model_type='gpt2'" in message and "qwen2" in message


def test_max_model_len_beyond_the_model_positions():
    message = config_error("rollout.max_model_len=513")
    assert "rollout.max_model_len = 513" in message and "max_position_embeddings=512" in message


@pytest.mark.parametrize("override, words", [("resharding.channel=carrier_pigeon", "resharding.channel='carrier_pigeon'"),
                                             ("resharding.bucket_mb=0", "resharding.bucket_mb=0")])
def test_resharding_settings_are_checked(override, words):
    assert words in config_error(override)


# The algorithm's settings: ranges and combinations that cannot work are refused before anything starts.
@pytest.mark.parametrize("overrides, words", [
    (["algorithm.adv_estimator=gae", "critic.enable=false"], ["needs a critic", "critic.enable=true"]),
    (["critic.enable=true"], ["critic.enable=true", "algorithm.adv_estimator=gae"]),
    (["algorithm.kl_ctrl.type=adaptive"], ["algorithm.use_kl_in_reward=true"]),
    (["actor.clip_ratio_c=0.5"], ["actor.clip_ratio_c=0.5", "> 1"]),
    (["algorithm.rollout_is_cap=0.5"], ["algorithm.rollout_is_cap=0.5", "at least 1"]),
    (["algorithm.rollout_correction.threshold=0.5"], ["algorithm.rollout_correction.threshold=0.5", "at least 1"]),
    (["algorithm.rollout_correction.level=tokens"], ["algorithm.rollout_correction.level='tokens'", "sequence"]),
    (["actor.clip_cov.lb=5", "actor.clip_cov.ub=1"], ["actor.clip_cov.lb=5.0", "actor.clip_cov.ub=1.0", "Swap"]),
    (["actor.clip_cov_lb=5", "actor.clip_cov_ub=1"], ["actor.clip_cov.lb=5.0", "actor.clip_cov.ub=1.0", "Swap"]),
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], ["rollout.n=1", "2 or more"]),
    (["algorithm.filter_groups.enable=true", "data.gen_batch_size=16"], ["data.gen_batch_size=16", "Raise"]),
    (["data.gen_batch_size=64"], ["data.gen_batch_size=64", "algorithm.filter_groups.enable=true"]),
    (["algorithm.filter_groups.metric=reward"], ["algorithm.filter_groups.metric='reward'", "acc, score"]),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.level=token"],
     ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.level=token", "Keep one"]),
    (["algorithm.rollout_is_cap=2", "algorithm.rollout_correction.level=sequence"],
     ["algorithm.rollout_is_cap=2", "algorithm.rollout_correction.level=sequence", "keep one"]),
    (["algorithm.gamma=1.5"], ["algorithm.gamma=1.5", "[0, 1]"]),
    (["actor.entropy_coeff=-0.1"], ["actor.entropy_coeff=-0.1"]),
    (["critic.warmup_steps=2"], ["critic.warmup_steps=2", "critic.warmup_steps=0"]),
    (["algorithm.adv_estimator=gae", "critic.warmup_steps=400"], ["critic.warmup_steps=400", "total_steps"]),
    (["algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=1"],
     ["critic.tensor_model_parallel_size=1", "actor.tensor_model_parallel_size=2", "critic.placement=separate"]),
    (["algorithm.adv_estimator=gae", "critic.placement=separate", "critic.n_gpus_per_node=3",
      "critic.tensor_model_parallel_size=2"], ["critic", "3 devices", "critic.tensor_model_parallel_size"]),
    (["ref.placement=separate"], ["nothing uses the reference", "actor.use_kl_loss=true"]),
    (["ref.placement=separate", "actor.use_kl_loss=true"], ["model.random_init=true", "ref.placement=colocated"]),
    (["critic.placement=separate"], ["no critic", "critic.placement=colocated"]),
    # asynchronous RL: engines of their own, partial rollouts only ahead of the trainer, continued one by one
    (["trainer.rollout_staleness=1"], ["trainer.rollout_staleness=1", "rollout.placement=separate"]),
    (["trainer.rollout_staleness=-1"], ["trainer.rollout_staleness=-1"]),
    (["trainer.async_mode=streaming"], ["trainer.async_mode=streaming", "rollout.placement=separate"]),
    (["trainer.async_mode=sync", "trainer.rollout_staleness=1"], ["trainer.async_mode=sync",
                                                                  "trainer.rollout_staleness=1", "set"]),
    (["trainer.async_mode=stream"], ["trainer.async_mode='stream'", "streaming"]),
    (["trainer.async_mode=streaming", "rollout.placement=separate", "rollout.function=my_pkg.rollouts:generate"],
     ["rollout.function=my_pkg.rollouts:generate", "agent loop", "trainer.async_mode=one_step_off"]),
    (["trainer.async_mode=streaming", "rollout.placement=separate", "rollout.partial_rollout_sync_at_tokens=4"],
     ["rollout.partial_rollout_sync_at_tokens=4", "null"]),
    (["trainer.async_mode=streaming", "rollout.placement=separate", "rollout.multi_turn.turn_synchronous=true"],
     ["rollout.multi_turn.turn_synchronous=true", "trainer.async_mode=streaming"]),
    (["rollout.partial_rollout=true"], ["rollout.partial_rollout=true", "trainer.rollout_staleness=1"]),
    (["trainer.rollout_staleness=1", "rollout.placement=separate", "rollout.partial_rollout=true",
      "rollout.multi_turn.turn_synchronous=true"], ["rollout.multi_turn.turn_synchronous=true",
                                                    "rollout.partial_rollout"]),
    (["rollout.partial_rollout_sync_at_tokens=4"], ["rollout.partial_rollout_sync_at_tokens=4",
                                                    "rollout.partial_rollout=true"]),
    (["trainer.rollout_staleness=2", "rollout.placement=separate", "rollout.partial_rollout=true",
      "rollout.partial_rollout_sync_at_tokens=4"], ["trainer.rollout_staleness=2", "trainer.rollout_staleness=1"]),
    (["trainer.rollout_staleness=1", "rollout.placement=separate", "rollout.partial_rollout=true",
      "rollout.max_tokens=16", "rollout.partial_rollout_sync_at_tokens=16"], ["rollout.max_tokens=16",
                                                                               "between 1 and 15"]),
    (["trainer.rollout_staleness=1", "rollout.placement=separate", "rollout.partial_rollout=true",
      "rollout.partial_rollout_sync_at_tokens=1"], ["rollout.max_tokens=1", "raise rollout.max_tokens"]),
    # a separate role's own layout against the model: its keys, not the actor's
    (["algorithm.adv_estimator=gae", "critic.placement=separate", "critic.n_gpus_per_node=4",
      "critic.tensor_model_parallel_size=4"], ["critic.tensor_model_parallel_size=4 must divide the model's"]),
])
def test_incompatible_algorithm_settings_are_named(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


def test_rollout_is_cap_is_the_token_truncate_shorthand():
    correction = load_demo("algorithm.rollout_is_cap=2").algorithm.rollout_correction
    assert (correction.level, correction.mode, correction.threshold) == ("token", "truncate", 2.0)
    assert load_demo().algorithm.rollout_correction.level is None


ASYNC = ("trainer.rollout_staleness=1", "rollout.placement=separate", "rollout.n_gpus_per_node=1",
         "trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1")


def test_stale_samples_are_clipped_against_the_policy_that_sampled_them_by_default():
    """bypass_mode unset (the default): on where the rollout may lag the trainer and no correction level is set, off
    in synchronous runs; an explicit setting, or a level (the shorthand too), is kept as written."""
    correction = load_demo(*ASYNC).algorithm.rollout_correction
    assert correction.bypass_mode is True and correction.level is None
    assert load_demo().algorithm.rollout_correction.bypass_mode is False
    assert load_demo(*ASYNC, "algorithm.rollout_correction.bypass_mode=false").algorithm.rollout_correction.bypass_mode \
        is False
    for setting in ("algorithm.rollout_correction.level=token", "algorithm.rollout_is_cap=3"):
        correction = load_demo(*ASYNC, setting).algorithm.rollout_correction
        assert correction.level == "token" and correction.bypass_mode is False
    assert load_demo("algorithm.rollout_correction.bypass_mode=true").algorithm.rollout_correction.bypass_mode


def test_critic_and_reference_default_to_the_actor_settings():
    cfg = load_demo("algorithm.adv_estimator=gae", "actor.use_kl_loss=true")
    assert cfg.critic.enable and cfg.critic.model_path == cfg.model.path
    assert (cfg.critic.tensor_model_parallel_size, cfg.critic.ppo_mini_batch_size, cfg.critic.micro_batch_size) == \
        (cfg.actor.tensor_model_parallel_size, cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size)
    assert cfg.ref.micro_batch_size == cfg.actor.micro_batch_size and not load_demo().critic.enable


@pytest.mark.parametrize("overrides, words", [
    (["trainer.save_every=-2"], ["trainer.save_every=-2", "-1 (never)"]),
    (["trainer.keep_last=-1"], ["trainer.keep_last=-1", "0 turns it off"]),
    (["trainer.resume=runs/nowhere/global_step_3"], ["trainer.resume='runs/nowhere/global_step_3'", "auto, off"]),
    (["model.checkpoint=ckpt/nowhere", "model.random_init=false"], ["model.checkpoint='ckpt/nowhere'", "from-hf"]),
    (["model.checkpoint=configs"], ["model.checkpoint and model.random_init=true"]),
])
def test_checkpoint_settings_are_checked(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


@pytest.mark.parametrize("overrides, words", [
    (["rollout.placement=remote"], ["rollout.placement='remote'", "separate"]),
    (["rollout.placement=separate", "rollout.n_gpus_per_node=0"], ["rollout.n_gpus_per_node"]),
    (["rollout.placement=separate", "rollout.n_gpus_per_node=3", "rollout.tensor_parallel_size=2"],
     ["rollout.tensor_parallel_size=2 must divide rollout.n_gpus_per_node=3"]),
    (["rollout.placement=separate", "rollout.n_gpus_per_node=3", "data.train_batch_size=16"],
     ["3 rollout engines"]),
])
def test_separate_rollout_settings_are_checked(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


@pytest.mark.parametrize("override, message", [
    ("rollout.function=no_such_module_xyz:rollout", "rollout.function='no_such_module_xyz:rollout': module "
                                                    "'no_such_module_xyz' was not found"),
    ("rollout.function=rl_megatron.rollout.default:no_such_fn", "has no attribute 'no_such_fn'"),
    ("rollout.function=generate", "rollout.function='generate' must be 'package.module:function'"),
    ("trainer.imports=[no_such_module_abc]", "trainer.imports entry 'no_such_module_abc': module 'no_such_module_abc' "
                                             "was not found"),
    ("trainer.imports=[/nonexistent/plugin.py]", "file '/nonexistent/plugin.py' was not found"),
])
def test_the_users_code_is_imported_before_anything_starts_and_named_when_it_fails(override, message):
    assert message in config_error(override)


def test_the_default_rollout_function_and_no_imports():
    cfg = load_demo()
    assert cfg.rollout.function == "rl_megatron.rollout.default:generate" and cfg.trainer.imports == []


def test_token_budget_lifts_the_micro_batch_divisibility_but_keeps_the_interleaving_rule(tmp_path):
    # 48 samples per mini-batch over 2 data-parallel ranks: no micro_batch_size to divide it with a token budget.
    cfg = load_demo("actor.tensor_model_parallel_size=1", "actor.micro_batch_size=48",
                    "actor.max_tokens_per_micro_batch=512")
    assert cfg.ref.max_tokens_per_micro_batch == cfg.critic.max_tokens_per_micro_batch == 512
    model = model_folder(tmp_path / "m", num_hidden_layers=4)
    # 2 devices at PP 2 -> DP 1; 3 prompts x 1 sample = 3 samples: not a multiple of PP for interleaving.
    message = config_error(f"model.path={model}", "actor.tensor_model_parallel_size=1",
                           "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2",
                           "actor.max_tokens_per_micro_batch=512", "actor.ppo_mini_batch_size=3", "rollout.n=1",
                           "data.train_batch_size=6")
    assert "3 samples" in message and "actor.pipeline_model_parallel_size=2" in message


def test_lora_keys_and_where_adapters_cannot_go_yet(tmp_path):
    from rl_megatron.config.pools import worker_pools
    from rl_megatron.roles import Role

    cfg = load_demo("actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]", "actor.use_kl_loss=true")
    assert cfg.actor.lora.rank == 8 and cfg.actor.lora.alpha == 16.0 and cfg.actor.lora.init == "kaiming"
    # The reference is the actor with its adapters off: no reference role anywhere, colocated or not.
    assert [pool.roles for pool in worker_pools(cfg)] == [(Role.ACTOR, Role.ROLLOUT)]
    message = config_error("actor.lora.rank=8", "actor.use_kl_loss=true", "ref.placement=separate",
                           "ref.tensor_model_parallel_size=1", "model.random_init=false")
    assert "ref.placement=separate" in message and "adapters" in message
    message = config_error("actor.lora.target_modules=[qkv]")
    assert "actor.lora.target_modules" in message and "q_proj" in message
    assert "actor.lora.rank" in config_error("actor.lora.rank=-1")
    assert "actor.lora.alpha" in config_error("actor.lora.alpha=0")
    # MoE experts and latent attention have no adapters yet: refused, naming the modules and what runs.
    moe = f"model.path={moe_folder(tmp_path / 'm')}"
    message = config_error(moe, "actor.lora.rank=8")
    assert "gate_proj, up_proj, down_proj" in message and "target_modules=[q_proj,k_proj,v_proj,o_proj]" in message
    assert load_demo(moe, "actor.lora.rank=8", "actor.lora.target_modules=[q_proj,o_proj]").actor.lora.rank == 8
    # The output layer of tied embeddings is the embedding, one tensor in the engines: no adapter of its own.
    assert load_demo("actor.lora.rank=8", "actor.lora.target_modules=[all-linear,lm_head]").actor.lora.rank == 8
    message = config_error(f"model.path={model_folder(tmp_path / 't', tie_word_embeddings=True)}",
                           "actor.lora.rank=8", "actor.lora.target_modules=[lm_head]")
    assert "lm_head" in message and "tie_word_embeddings" in message
    mla = f"model.path={os.path.join(REPO, 'configs', 'models', 'tiny-deepseek-v3-digits')}"
    message = config_error(mla, "actor.lora.rank=8", "actor.lora.target_modules=[o_proj]")
    assert "latent attention" in message and "actor.lora.rank=0" in message


def test_lora_engines_load_the_adapters_unless_vllm_cannot_serve_them():
    from rl_megatron.rollout.engine import engine_lora_rank, lora_merge_reason

    # Served by the engines (vLLM's max_lora_rank: the smallest of its choices that holds the rank).
    for rank, engine_rank in ((8, 8), (12, 16), (64, 64), (300, 320), (512, 512)):
        cfg = load_demo(f"actor.lora.rank={rank}")
        assert lora_merge_reason(cfg) is None and engine_lora_rank(cfg) == engine_rank
    # Merged, saying why: asked for, the output layer's adapters, above vLLM's largest rank, separate engines.
    reasons = {("actor.lora.merge=true",): "actor.lora.merge=true",
               ("actor.lora.target_modules=[all-linear,lm_head]",): "no LoRA adapter on lm_head",
               ("actor.lora.rank=1024",): "up to rank 512 (actor.lora.rank=1024)",
               ("rollout.placement=separate", "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=1",
                "actor.tensor_model_parallel_size=1"): "rollout.placement=separate"}
    for overrides, reason in reasons.items():
        cfg = load_demo("actor.lora.rank=8", *overrides)
        assert reason in lora_merge_reason(cfg) and engine_lora_rank(cfg) == 0
    plain = load_demo()
    assert lora_merge_reason(plain) is None and engine_lora_rank(plain) == 0  # no LoRA: nothing to serve


def test_the_async_mode_follows_the_staleness_unless_set():
    """Unset: sync at rollout_staleness 0, one_step_off above; streaming bounds every token at 1 version when the
    staleness is left at 0, and continues requests across weight updates (partial rollouts)."""
    assert load_demo().trainer.async_mode == "sync"
    assert load_demo(*ASYNC).trainer.async_mode == "one_step_off"
    streaming = load_demo(*ASYNC[1:], "trainer.async_mode=streaming")
    assert (streaming.trainer.rollout_staleness, streaming.rollout.partial_rollout) == (1, True)
    assert load_demo(*ASYNC[1:], "trainer.async_mode=streaming", "trainer.rollout_staleness=3").trainer \
        .rollout_staleness == 3
    one_step_off = load_demo(*ASYNC[1:], "trainer.async_mode=one_step_off")
    assert (one_step_off.trainer.rollout_staleness, one_step_off.rollout.partial_rollout) == (1, False)
