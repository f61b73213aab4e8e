"""On-policy distillation without workers: the advantage and the reverse KL against hand-computed values, the teacher
section's checks before anything starts (each a ConfigError naming the key and the fix), where the teacher is placed,
and the memory plan counting it."""
import math
import os

import pytest
import torch

from helpers.runs import REPO
from rl_megatron.algorithms import distillation_advantages, reverse_kl, top_k_kl
from rl_megatron.config import ConfigError
from rl_megatron.config.pools import worker_pools
from rl_megatron.doctor.parity import family_model_dir
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.tiny import TEXT, write_tiny_model
from rl_megatron.planning import build_plan
from rl_megatron.planning.memory import GIB, rank_parameters
from rl_megatron.planning.phase_memory import over_memory
from rl_megatron.preflight import load_config
from rl_megatron.preflight.dry_run import load_plan_config
from rl_megatron.roles import Role
from rl_megatron.trainer.old_log_probs import old_log_probs_from_update

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
GRAPHS = int(1.5 * GIB)  # the sleeping engine's CUDA graphs, as the plan allows them
# A teacher of its own: another family, more and wider layers than the demo's 2-layer Qwen2, the digits tokenizer.
TEACHER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


# ------------------------------------------------------------------------------------------------------ the math

MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
TEACHER_LOG_PROBS = torch.tensor([[-0.5, -1.0, -3.0], [-9.0, -0.2, -2.0]])
POLICY_LOG_PROBS = torch.tensor([[-1.0, -0.5, -0.1], [-7.0, -0.7, -1.0]])


def test_distillation_alone_is_coef_times_teacher_minus_policy_per_token():
    # teacher - policy on the response tokens: 0.5, -0.5 | 0.5, -1.0; x 2; 0 outside the mask.
    advantages = distillation_advantages(None, TEACHER_LOG_PROBS, POLICY_LOG_PROBS, MASK, coef=2.0)
    assert torch.equal(advantages, torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.0, -2.0]]))


def test_mixed_adds_the_term_to_the_task_advantages_token_by_token():
    task = torch.tensor([[0.3, 0.3, 0.3], [-0.4, -0.4, -0.4]])  # one value per sequence, broadcast (GRPO's)
    advantages = distillation_advantages(task, TEACHER_LOG_PROBS, POLICY_LOG_PROBS, MASK, coef=0.5)
    # 0.3 + 0.25, 0.3 - 0.25 | -0.4 + 0.25, -0.4 - 0.5: undiscounted, each token its own term.
    assert torch.allclose(advantages, torch.tensor([[0.55, 0.05, 0.0], [0.0, -0.15, -0.9]]))


def test_reverse_kl_is_the_mean_of_policy_minus_teacher_over_response_tokens():
    # (-0.5 + 0.5 - 0.5 + 1.0) / 4
    assert reverse_kl(POLICY_LOG_PROBS, TEACHER_LOG_PROBS, MASK) == pytest.approx(0.125)
    assert reverse_kl(TEACHER_LOG_PROBS, TEACHER_LOG_PROBS, MASK) == 0.0


def test_top_k_kl_is_the_teachers_probability_times_its_log_ratio_summed_over_its_k_tokens():
    teacher = torch.log(torch.tensor([[[0.5, 0.25], [0.9, 0.05]]]))  # [B=1, S=2, k=2]
    policy = torch.log(torch.tensor([[[0.25, 0.25], [0.9, 0.1]]]))
    expected = [0.5 * math.log(2) + 0.25 * 0.0, 0.9 * 0.0 + 0.05 * math.log(0.5)]
    assert top_k_kl(teacher, policy)[0].tolist() == pytest.approx(expected)
    assert torch.equal(top_k_kl(teacher, teacher), torch.zeros(1, 2))
    # Its gradient in the policy: minus the teacher's probabilities (the policy's log-probs as the variables).
    policy.requires_grad_()
    top_k_kl(teacher, policy).sum().backward()
    assert torch.allclose(policy.grad, -teacher.exp())


# ------------------------------------------------------------------------------------------------ the config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    return family_model_dir(tmp_path_factory.mktemp("teacher"), "llama", tied=True, layers=4, **TEACHER)


def load_demo(*overrides):
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_demo(*overrides)
    return str(info.value)


def test_a_teacher_runs_in_the_actors_workers_or_its_own_pool(teacher_dir):
    cfg = load_demo(f"teacher.model.path={teacher_dir}")
    assert [pool.roles for pool in worker_pools(cfg)] == [(Role.ACTOR, Role.ROLLOUT, Role.TEACHER)]
    assert (cfg.teacher.tensor_model_parallel_size, cfg.teacher.micro_batch_size) == (2, 64)  # the actor's
    separate = load_demo(f"teacher.model.path={teacher_dir}", "teacher.placement=separate",
                         "teacher.tensor_model_parallel_size=1", "teacher.n_gpus_per_node=2")
    pools = worker_pools(separate)
    assert [(p.name, p.roles, p.world_size, p.layout) for p in pools[1:]] == [
        (Role.TEACHER, (Role.TEACHER,), 2, {"tp": 1, "pp": 1})]
    assert pools[1].nodes_key == "teacher.nnodes"
    # Validation generates and scores: no teacher.
    assert [p.roles for p in worker_pools(load_demo(f"teacher.model.path={teacher_dir}", "trainer.val_only=true"))
            ] == [(Role.ACTOR, Role.ROLLOUT)]
    # The distillation term reads the old log-probs before the update: their pass stays, even in one optimizer step.
    one_step = ("data.train_batch_size=16", "actor.ppo_mini_batch_size=16")
    assert old_log_probs_from_update(load_demo(*one_step), read_hf_config(DEMO_MODEL))
    assert not old_log_probs_from_update(load_demo(*one_step, f"teacher.model.path={teacher_dir}"),
                                         read_hf_config(DEMO_MODEL))


@pytest.mark.parametrize("overrides,words", [
    (["algorithm.distillation.coef=0.5"], ["algorithm.distillation.coef", "teacher.model.path"]),
    (["algorithm.distillation.mode=alone"], ["algorithm.distillation.mode", "teacher.model.path"]),
    (["teacher.placement=separate"], ["teacher.placement", "no teacher", "teacher.model.path"]),
    (["algorithm.distillation.coef=0"], ["algorithm.distillation.coef=0", "> 0"]),
    (["algorithm.distillation.mode=reverse"], ["algorithm.distillation.mode='reverse'", "mixed, alone"]),
    (["algorithm.distillation.top_k=16"], ["algorithm.distillation.top_k", "teacher.model.path"]),
    (["algorithm.distillation.top_k=0"], ["algorithm.distillation.top_k=0", "e.g. 64"]),
])
def test_distillation_keys_without_a_teacher_or_out_of_range_are_named(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


def test_the_teachers_own_keys_are_checked_before_anything_starts(teacher_dir, tmp_path):
    teacher = f"teacher.model.path={teacher_dir}"
    message = config_error(teacher, "algorithm.distillation.mode=alone", "algorithm.adv_estimator=gae")
    assert "algorithm.distillation.mode=alone" in message and "algorithm.adv_estimator=grpo" in message
    message = config_error(teacher, "algorithm.distillation.mode=alone", "algorithm.use_kl_in_reward=true")
    assert "algorithm.use_kl_in_reward=true" in message and "actor.use_kl_loss=true" in message
    # Colocated, it runs in the actor's processes: their layout.
    message = config_error(teacher, "teacher.tensor_model_parallel_size=1")
    assert "teacher.tensor_model_parallel_size=1" in message and "teacher.placement=separate" in message
    # Its own model against its own layout: 4 heads over 2 key/value heads at TP=4.
    message = config_error(teacher, "teacher.placement=separate", "teacher.n_gpus_per_node=4",
                           "teacher.tensor_model_parallel_size=4")
    assert "teacher.tensor_model_parallel_size=4" in message and "teacher.model.path's config.json" in message
    message = config_error(f"teacher.model.path={tmp_path / 'nowhere'}")
    assert "teacher.model.path=" in message and "is not a folder" in message
    # A folder without weights: the teacher always loads its own.
    bare = write_tiny_model(str(tmp_path / "bare"))
    assert "teacher.model.path" in config_error(f"teacher.model.path={bare}")


def test_a_teacher_with_another_tokenizer_is_refused_naming_it(tmp_path):
    other = write_tiny_model(str(tmp_path / "text"), with_weights=True, vocabulary=TEXT)
    message = config_error(f"teacher.model.path={other}")
    assert f"teacher.model.path='{other}'" in message and "not the policy's" in message
    assert "id 4" in message and "teacher.model.path=null" in message  # the first token that differs


# -------------------------------------------------------------------------------------------- the memory plan


def cluster(teacher_dir, *extra):
    return load_config(DEMO, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor.micro_batch_size=4",
                              "model.dtype=bfloat16", "actor.tensor_model_parallel_size=2",
                              "rollout.gpu_memory_utilization=0.4", f"teacher.model.path={teacher_dir}", *extra])


def test_the_plan_counts_the_teachers_weights_and_its_pass(teacher_dir):
    """Colocated with actor.offload on GPU: the teacher's bf16 weights (its own model's, at the actor's TP=2) come in
    for its pass beside the actor's weights, with its activations and the sleeping engine's graphs: a phase of its
    own. With teacher.param_offload=false they stay in every phase instead."""
    teacher_params = rank_parameters(read_hf_config(teacher_dir), tp=2).total
    pool = build_plan(cluster(teacher_dir), gpu_memory_gib=80).pools[0]
    roles = {role.name: role for role in pool.roles}
    teacher, actor = roles[Role.TEACHER], roles[Role.ACTOR]
    assert teacher.layout == "TP=2 PP=1 CP=1 EP=1 DP=8" and teacher.memory_bytes == teacher_params * 2
    assert teacher.activation_bytes > 0 and teacher.engine == "Megatron forward"
    phases = {phase.name: phase for phase in pool.phases}
    assert list(phases) == ["training", "generation", "weight sync", "teacher forward"]
    assert phases["teacher forward"].bytes == actor.weight_bytes + teacher_params * 2 + teacher.activation_bytes + \
        GRAPHS
    assert "teacher" not in {item.what for item in phases["training"].held}
    # Over the GPU in its pass too: its own keys, and its own GPUs, are named.
    message = over_memory(pool, cluster(teacher_dir), 1e-4, "GPU_MEMORY_GIB")
    assert "teacher forward ~" in message and "teacher.max_tokens_per_micro_batch=null" in message
    assert "teacher.placement=colocated to separate" in message
    kept = build_plan(cluster(teacher_dir, "teacher.param_offload=false"), gpu_memory_gib=80).pools[0]
    assert [phase.name for phase in kept.phases] == ["training", "generation", "weight sync"]
    assert all(next(item.bytes for item in phase.held if item.what == "teacher") == teacher_params * 2
               for phase in kept.phases)


def test_a_dry_run_plans_a_teacher_that_is_not_on_this_machine_from_its_shipped_config():
    """A cluster's teacher (/models/Qwen2.5-7B-Instruct) planned on a laptop: its config.json shipped with rl_megatron
    stands in, as the policy's does, and the plan counts its parameters, not the policy's."""
    plan_config = load_plan_config(DEMO, ["model.path=/models/Qwen2.5-3B-Instruct", "model.random_init=true",
                                          "teacher.model.path=/models/Qwen2.5-7B-Instruct", "model.dtype=bfloat16"])
    shipped = plan_config.stand_ins["/models/Qwen2.5-7B-Instruct"]
    assert plan_config.cfg.teacher.model.path == shipped and shipped.endswith("configs/models/Qwen2.5-7B-Instruct")
    teacher = next(role for role in build_plan(plan_config.cfg, gpu_memory_gib=141, refuse_over_memory=False)
                   .pools[0].roles if role.name == Role.TEACHER)
    assert teacher.memory_bytes == rank_parameters(read_hf_config(shipped), tp=2).total * 2


def test_a_separate_teacher_pool_holds_its_weights_and_activations(teacher_dir):
    cfg = cluster(teacher_dir, "teacher.placement=separate", "teacher.n_gpus_per_node=4",
                  "teacher.tensor_model_parallel_size=1")
    plan = build_plan(cfg, gpu_memory_gib=80)
    assert [(pool.name, pool.first_node, pool.world) for pool in plan.pools] == [("actor", 0, 16), ("teacher", 2, 4)]
    pool = plan.pools[1]
    (teacher,) = pool.roles
    assert teacher.memory_bytes == rank_parameters(read_hf_config(teacher_dir)).total * 2
    assert [(phase.name, phase.bytes) for phase in pool.phases] == [
        ("all at once", teacher.memory_bytes + teacher.activation_bytes)]
    # Over a small GPU, the teacher's own keys are named.
    message = over_memory(pool, cfg, 1e-4, "GPU_MEMORY_GIB")
    assert message.startswith("the teacher pool needs") and "teacher.max_tokens_per_micro_batch=null" in message
    assert "teacher.tensor_model_parallel_size=1 / teacher.pipeline_model_parallel_size=1 higher" in message
