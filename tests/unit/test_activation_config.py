"""Sequence parallelism and activation recomputation: the keys (actor.sequence_parallel, actor.recompute_* and the
critic's), what each role builds from them (`ActivationSettings`), what reaches Megatron's TransformerConfig, and
every combination Megatron would refuse in a worker refused at load time, naming the key and the fix. No processes,
no Megatron state: well under a second each."""
import itertools
import os

import pytest
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.models.hf_config import model_config
from rl_megatron.preflight import load_config
from rl_megatron.models.activations import ActivationSettings, sequence_parallel_on
from rl_megatron.models.gpt import transformer_config
from rl_megatron.roles import Role

DENSE = (os.path.join(REPO, "configs", "demo_cpu.yaml"), os.path.join(REPO, "configs", "models", "tiny-qwen2-digits"))
MOE = (os.path.join(REPO, "configs", "moe", "grpo_tiny_qwen3_moe_cpu.yaml"),
       os.path.join(REPO, "configs", "models", "tiny-qwen3-moe-digits"))
FULL_UNIFORM = ("actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1")
WITH_CRITIC = ("algorithm.adv_estimator=gae",)


def load(*overrides, model=DENSE):
    path, folder = model
    return load_config(path, [f"model.path={folder}", *overrides])


def error(*overrides, model=DENSE) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, model=model)
    return str(info.value)


def megatron_config(cfg, role: Role, tp: int):
    """What the role's workers would build (the demo is a 2-layer dense model, PP=1)."""
    return transformer_config(model_config(cfg), tp=tp, pp=1, dtype="float32",
                              activations=ActivationSettings.of_role(cfg, role))


# ----------------------------------------------------------------------------------------- sequence parallelism


def test_sequence_parallelism_unset_is_on_at_tp_above_one_on_gpu_and_on_cpu_where_the_model_needs_it():
    """Megatron's recommendation on GPU; on CPU (gloo: a round trip per all-gather and reduce-scatter) only for the
    models that train at TP > 1 with it alone (MoE, Gated DeltaNet)."""
    for cuda, required in itertools.product((True, False), repeat=2):
        assert sequence_parallel_on(None, tp=2, cuda=cuda, required=required) is (cuda or required)
        assert sequence_parallel_on(None, tp=1, cuda=cuda, required=required) is False
        assert sequence_parallel_on(False, tp=2, cuda=cuda, required=required) is False
        assert sequence_parallel_on(True, tp=2, cuda=cuda, required=required) is True
    cfg = load()  # the demo: a dense Qwen2 at TP=2, actor.sequence_parallel unset
    assert cfg.actor.sequence_parallel is None
    assert megatron_config(cfg, Role.ACTOR, tp=2).sequence_parallel is False  # this CPU machine
    assert megatron_config(cfg, Role.ACTOR, tp=1).sequence_parallel is False
    assert megatron_config(load("actor.sequence_parallel=true"), Role.ACTOR, tp=2).sequence_parallel is True
    moe = load("actor.tensor_model_parallel_size=2", "actor.expert_model_parallel_size=1", model=MOE)
    assert moe.actor.sequence_parallel is None and megatron_config(moe, Role.ACTOR, tp=2).sequence_parallel is True


def test_sequence_parallel_false_turns_it_off_for_every_role():
    cfg = load("actor.sequence_parallel=false", *WITH_CRITIC)
    for role in (Role.ACTOR, Role.REF, Role.CRITIC):
        assert megatron_config(cfg, role, tp=2).sequence_parallel is False, role


def test_sequence_parallel_true_at_tp_one_is_off_not_an_error():
    """One rank has nothing to split; a separate reference at TP 1 follows the actor's key set for its TP 2."""
    assert not sequence_parallel_on(True, tp=1, cuda=True, required=True)
    cfg = load("actor.sequence_parallel=true", "actor.tensor_model_parallel_size=1")
    config = megatron_config(cfg, Role.ACTOR, tp=1)  # Megatron itself raises for sequence_parallel at TP 1
    assert config.sequence_parallel is False


def test_moe_at_tp_above_one_needs_sequence_parallelism():
    moe_tp2 = ("actor.tensor_model_parallel_size=2", "actor.expert_model_parallel_size=1")
    message = error("actor.sequence_parallel=false", *moe_tp2, model=MOE)
    assert "actor.sequence_parallel=false" in message and "MoE" in message
    assert "Remove actor.sequence_parallel" in message and "actor.tensor_model_parallel_size=1" in message
    assert load(*moe_tp2, model=MOE).actor.sequence_parallel is None  # the fix: on by default
    # At TP 1 there is nothing to split: off is what it is anyway.
    assert load("actor.sequence_parallel=false", model=MOE).actor.sequence_parallel is False


# ----------------------------------------------------------------------------------------------- recomputation


def test_recompute_keys_reach_megatron():
    config = megatron_config(load(*FULL_UNIFORM), Role.ACTOR, tp=2)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        ("full", "uniform", 1)
    config = megatron_config(load("actor.recompute_granularity=full", "actor.recompute_method=block",
                                  "actor.recompute_num_layers=2"), Role.ACTOR, tp=2)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    config = megatron_config(load("actor.recompute_granularity=selective"), Role.ACTOR, tp=2)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]
    assert config.recompute_method is None and config.recompute_num_layers is None
    assert megatron_config(load(), Role.ACTOR, tp=2).recompute_granularity is None


def test_the_reference_never_recomputes_and_the_critic_follows_the_actor_unless_it_says_otherwise():
    cfg = load(*FULL_UNIFORM, *WITH_CRITIC)
    assert ActivationSettings.of_role(cfg, Role.REF) == ActivationSettings()
    assert ActivationSettings.of_role(cfg, Role.CRITIC) == ActivationSettings.of_role(cfg, Role.ACTOR) == \
        ActivationSettings(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # The critic's own granularity takes none of the actor's method and layer count (selective accepts neither).
    cfg = load(*FULL_UNIFORM, *WITH_CRITIC, "critic.recompute_granularity=selective")
    assert (cfg.critic.recompute_granularity, cfg.critic.recompute_method, cfg.critic.recompute_num_layers) == \
        ("selective", None, None)
    assert megatron_config(cfg, Role.CRITIC, tp=2).recompute_modules == ["core_attn"]


@pytest.mark.parametrize("overrides, words", [
    (["actor.recompute_granularity=full"],
     ["actor.recompute_granularity=full needs actor.recompute_method", "actor.recompute_num_layers=1"]),
    (["actor.recompute_granularity=full", "actor.recompute_method=block"], ["needs actor.recompute_method"]),
    (["actor.recompute_granularity=full", "actor.recompute_num_layers=1"], ["actor.recompute_method=uniform"]),
    (["actor.recompute_granularity=selective", "actor.recompute_method=uniform"],
     ["selective", "actor.recompute_method=uniform", "Remove them"]),
    (["actor.recompute_granularity=selective", "actor.recompute_num_layers=1"], ["actor.recompute_num_layers=1"]),
    (["actor.recompute_method=uniform", "actor.recompute_num_layers=1"],
     ["actor.recompute_method=uniform and actor.recompute_num_layers=1", "set actor.recompute_granularity=full"]),
    # The demo's 2 layers in one chunk: uniform groups of 3 would run past the last layer (Megatron: IndexError).
    (["actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=3"],
     ["2 layers", "actor.recompute_num_layers=3", "divisor of 2"]),
    (["actor.recompute_granularity=full", "actor.recompute_method=block", "actor.recompute_num_layers=3"],
     ["actor.recompute_num_layers=3 exceeds the 2 layers", "at most 2"]),
    # PP=2: one layer per chunk, so groups of 2 do not fit.
    (["actor.tensor_model_parallel_size=1", "actor.pipeline_model_parallel_size=2", "actor.recompute_granularity=full",
      "actor.recompute_method=uniform", "actor.recompute_num_layers=2"], ["1 layers", "divisor of 1"]),
    (["actor.recompute_num_layers=0"], ["actor.recompute_num_layers=0"]),
    (["actor.recompute_granularity=partial"], ["actor.recompute_granularity", "selective"]),
])
def test_recompute_combinations_megatron_refuses_are_config_errors(overrides, words):
    message = error(*overrides)
    for word in words:
        assert word in message, (word, message)


def test_the_critics_recompute_keys_are_checked_under_its_own_name_and_layout():
    message = error(*WITH_CRITIC, "critic.recompute_granularity=full", "critic.recompute_method=uniform")
    assert "critic.recompute_granularity=full needs critic.recompute_method" in message
    # A critic on its own 2 pipeline stages has 1 layer per chunk, where the actor's whole model has 2.
    separate = (*WITH_CRITIC, "critic.placement=separate", "critic.n_gpus_per_node=2", "model.random_init=false",
                "critic.tensor_model_parallel_size=1", "critic.pipeline_model_parallel_size=2")
    message = error(*separate, "actor.recompute_granularity=full", "actor.recompute_method=block",
                    "actor.recompute_num_layers=2")
    assert "critic.recompute_num_layers=2 exceeds the 1 layers" in message
