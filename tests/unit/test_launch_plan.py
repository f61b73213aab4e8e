"""The multi-node launch plan: parameter counts from config.json, memory per GPU, placement checks, this
node's role from torchrun-style / SLURM variables, and Ray's authentication."""
import json
import os
import socket
import stat
import threading

import pytest

from helpers.ports import closed_port
from rl_megatron.config import ConfigError
from rl_megatron.config.pools import worker_pools
from rl_megatron.preflight import load_config
from rl_megatron.planning import build_plan, format_plan
from rl_megatron.launch.__main__ import check_environment, describe_node, plan_node, shell_assignments
from rl_megatron.launch.auth import ray_auth, write_token_file
from rl_megatron.launch.environment import LaunchError, detect_node, expand_hostlist
from rl_megatron.planning.engine_cache import sample_cache
from rl_megatron.planning.memory import (GIB, ModelShape, RankParameters, RolePasses, activation_bytes,
                                         rank_parameters, training_state_bytes)
from rl_megatron.launch.ray_cluster import cluster_shortfall, wait_for_head
from rl_megatron.workers.cluster import port_open

DEMO = "configs/demo_cpu.yaml"
TINY = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 18,
        "tie_word_embeddings": False}
TINY_QWEN2 = json.load(open("configs/models/tiny-qwen2-digits/config.json"))
GRAPHS = int(1.5 * GIB)  # the sleeping engine's CUDA graphs, as the plan allows them


def dense_layer(h, heads, kv, head_dim, ffn, qkv_bias, qk_norm):
    """Independent closed form of one decoder layer of the Llama/Qwen family."""
    q, k = heads * head_dim, kv * head_dim
    attention = h * q + 2 * h * k + q * h + (q + 2 * k if qkv_bias else 0) + (2 * head_dim if qk_norm else 0)
    return attention + 3 * h * ffn + 2 * h


def test_dense_count_matches_closed_form_whole_and_sharded():
    layer = dense_layer(64, 2, 2, 32, 128, qkv_bias=True, qk_norm=False)
    assert rank_parameters(TINY).total == 2 * layer + 18 * 64 * 2 + 64
    # TP=2 halves every matrix and the QKV bias; norms are replicated. Vocab 18 pads to 2 x 9 rows.
    sharded = rank_parameters(TINY, tp=2)
    per_layer = (layer - 2 * 64) // 2 + 2 * 64
    assert sharded == RankParameters(dense=2 * per_layer + 2 * 9 * 64 + 64, expert=0)
    # PP=2: the fuller stage is the last (output layer + final norm) vs the first (embedding).
    assert rank_parameters(TINY, pp=2).total == layer + 18 * 64 + 64


def test_tied_embedding_counted_once_on_one_stage_and_twice_across_stages():
    tied = dict(TINY, tie_word_embeddings=True, model_type="llama")
    layer = dense_layer(64, 2, 2, 32, 128, qkv_bias=False, qk_norm=False)
    assert rank_parameters(tied).total == 2 * layer + 18 * 64 + 64
    assert rank_parameters(tied, pp=2).total == layer + 18 * 64 + 64  # the last stage keeps its own copy


def test_moe_experts_split_over_ep_and_sharded_optimizer_state():
    moe = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
           "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 40, "tie_word_embeddings": False}
    attention_and_norms = dense_layer(32, 4, 2, 8, 0, qkv_bias=False, qk_norm=True)
    router, expert = 8 * 32, 3 * 32 * 16
    whole = rank_parameters(moe)
    assert whole == RankParameters(dense=2 * (attention_and_norms + router) + 40 * 32 * 2 + 32, expert=2 * 8 * expert)
    assert rank_parameters(moe, ep=4).expert == 2 * 2 * expert
    # bf16: 2 (weights) + 4 (fp32 grads) + 12 (master + Adam) / shards; experts shard over DP / EP.
    params = RankParameters(dense=1000, expert=800)
    assert training_state_bytes(params, "bfloat16", dp=4, ep=2, cp=1, distributed_optimizer=True) == \
        1000 * (6 + 12 / 4) + 800 * (6 + 12 / 2)
    assert training_state_bytes(params, "float32", dp=4, ep=2, cp=1, distributed_optimizer=False) == 1800 * 16
    # Experts whole (expert TP 1) beside attention at TP 2: the experts' shards are TP 1's, and their optimizer
    # state shards over TP x DP / (ETP x EP) = 2 x 4 / 2 ranks.
    assert rank_parameters(moe, tp=2, ep=4, etp=1).expert == rank_parameters(moe, ep=4).expert
    assert rank_parameters(moe, tp=2, ep=4, etp=1).dense == rank_parameters(moe, tp=2, ep=4).dense
    assert training_state_bytes(params, "bfloat16", dp=4, ep=2, cp=1, distributed_optimizer=True, tp=2, etp=1) == \
        1000 * (6 + 12 / 4) + 800 * (6 + 12 / 4)


def cluster(*extra):
    return load_config(DEMO, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor.micro_batch_size=4",
                              "model.dtype=bfloat16", *extra])


def test_plan_places_roles_and_estimates_memory():
    cfg = cluster("actor.tensor_model_parallel_size=2", "actor.pipeline_model_parallel_size=2",
                  "actor.use_kl_loss=true", "rollout.gpu_memory_utilization=0.4", "actor.offload=false")
    plan = build_plan(cfg, gpu_memory_gib=80)
    assert (plan.nnodes, plan.gpus_per_node, plan.total_gpus) == (2, 8, 16)
    roles = {role.name: role for role in plan.pools[0].roles}
    assert roles["actor"].layout == "TP=2 PP=2 CP=1 EP=1 DP=4" and roles["ref"].layout == roles["actor"].layout
    assert roles["rollout"].layout == "TP=1, 16 engines"
    assert roles["rollout"].memory_bytes == int(0.4 * 80 * 2 ** 30)
    # Its cache beside the weights, in samples of rollout.max_model_len (engine_cache.py's per-sample bytes).
    per_sample = sample_cache(TINY_QWEN2, 1, "bfloat16").sample_bytes(cfg.rollout.max_model_len)
    samples = (roles["rollout"].memory_bytes - roles["rollout"].weight_bytes) // per_sample
    assert f"~{samples} samples of max_model_len={cfg.rollout.max_model_len} at once" in roles["rollout"].memory_note
    per_rank = rank_parameters(TINY_QWEN2, tp=2, pp=2)
    assert roles["actor"].memory_bytes == int(per_rank.total * (6 + 12 / 4))
    assert roles["ref"].memory_bytes == per_rank.total * 2
    # Without actor.offload the pool holds it all at once: every role's state, the engine's share, and the larger
    # of the actor's and the reference's activations (one pass at a time).
    assert roles["actor"].activation_bytes > roles["ref"].activation_bytes > 0
    assert plan.pools[0].memory_bytes == sum(role.memory_bytes for role in roles.values()) + \
        roles["actor"].activation_bytes
    text = format_plan(cfg, gpu_memory_gib=80)
    assert "nodes 0-1: actor pool, 2 x 8 = 16 GPUs" in text and "PP stage = 8 GPUs = 1 node(s)" in text
    assert "activations  actor" in text and "activations  ref" in text and "(the actor's; one pass at a time)" in text
    assert "phases       all at once (actor.offload=false" in text
    assert "WARNING" not in text
    # The engine takes the whole GPU, so the training state no longer fits beside it: refused, the GPU's size known,
    # with offloading as a way out.
    with pytest.raises(ConfigError, match="The actor pool needs .* more than the GPU's 1 GiB .*"
                                          "rollout.gpu_memory_utilization=1.0 lower.*actor.offload=false to true"):
        format_plan(cluster("rollout.gpu_memory_utilization=1.0", "actor.offload=false"), gpu_memory_gib=1)
    # A GPU too small for the engine's own weights (84.9 K bf16 parameters = 170 KB): a warning (the plan is
    # refused too, its state being over such a GPU, unless asked to describe it anyway as the doctor does).
    tiny_gpu = build_plan(cfg, gpu_memory_gib=1e-4, refuse_over_memory=False)
    assert any("the vLLM engine's weights" in warning for warning in tiny_gpu.warnings)


def test_with_offload_the_pool_needs_its_largest_phase_not_the_sum():
    """actor.offload (the default): the engine and Megatron's state take turns, by hand at TP=2 x PP=2 with a KL
    reference and an engine share of 0.4 x 80 GiB. Training: the actor's state + its activations + the sleeping
    engine's CUDA graphs; generation: the engine's share; weight sync: both models' bf16 weights + 256 MiB of
    buckets + the graphs. The reference's weights wait in host memory (ref.param_offload) and count nowhere."""
    overrides = ["actor.tensor_model_parallel_size=2", "actor.pipeline_model_parallel_size=2",
                 "actor.use_kl_loss=true", "rollout.gpu_memory_utilization=0.4"]
    pool = build_plan(cluster(*overrides), gpu_memory_gib=80).pools[0]
    per_rank = rank_parameters(TINY_QWEN2, tp=2, pp=2).total
    whole = rank_parameters(TINY_QWEN2).total  # one engine per GPU (rollout TP 1): the whole model
    actor = next(role for role in pool.roles if role.name == "actor")
    training = int(per_rank * (6 + 12 / 4)) + actor.activation_bytes + GRAPHS
    generation = int(0.4 * 80 * GIB)
    sync = per_rank * 2 + whole * 2 + 256 * 2 ** 20 + GRAPHS
    assert [(phase.name, phase.bytes) for phase in pool.phases] == [
        ("training", training), ("generation", generation), ("weight sync", sync)]
    assert pool.memory_bytes == generation and pool.peak.name == "generation"
    text = format_plan(cluster(*overrides), gpu_memory_gib=80)
    assert "actor pool: 32.0 GiB at its peak (generation), of actor" in text
    assert "phases       one at a time (actor.offload): training 1.5 GiB (actor 0.0 + activations 0.0 + CUDA graphs " \
           "1.5) | generation 32.0 GiB, the peak (rollout 32.0) | weight sync 1.8 GiB (actor weights 0.0 + engine " \
           "weights 0.0 + buckets 0.2 + CUDA graphs 1.5)" in text
    # ref.param_offload=false: its weights stay on the GPU in every phase.
    kept = build_plan(cluster(*overrides, "ref.param_offload=false"), gpu_memory_gib=80).pools[0]
    assert [phase.bytes for phase in kept.phases] == [training + per_rank * 2, generation + per_rank * 2,
                                                      sync + per_rank * 2]
    # The same pool without offloading needs the sum; the phases are no more.
    summed = build_plan(cluster(*overrides, "actor.offload=false"), gpu_memory_gib=80).pools[0]
    assert [phase.name for phase in summed.phases] == ["all at once"]
    assert summed.memory_bytes == int(per_rank * (6 + 12 / 4)) + per_rank * 2 + generation + actor.activation_bytes
    # On CPU slots nothing moves and the engine never sleeps: the sum too.
    assert [phase.name for phase in build_plan(cluster(*overrides), on_gpu=False).pools[0].phases] == ["all at once"]


def test_the_sleeping_engines_graphs_never_exceed_what_its_share_leaves_beside_its_weights():
    """vLLM fits its CUDA graphs in its share: on a 1 GiB GPU at 0.5 the allowance is 0.5 GiB less the weights."""
    pool = build_plan(cluster("actor.tensor_model_parallel_size=2"), gpu_memory_gib=1).pools[0]
    engine = next(role for role in pool.roles if role.name == "rollout")
    graphs = next(item for item in pool.phases[0].held if item.what == "CUDA graphs")
    assert graphs.bytes == int(0.5 * GIB) - engine.weight_bytes
    assert engine.weight_bytes == rank_parameters(TINY_QWEN2).total * 2  # bf16, one engine per GPU


def test_the_weight_sync_can_be_the_peak_and_names_its_keys():
    """4 GiB buckets beside a small engine share: the sync (both models' weights, the buckets, the graphs) is the
    largest phase; over a 4 GiB GPU it is refused, naming the sync's keys, not the training's or the engine's."""
    overrides = ["actor.tensor_model_parallel_size=2", "rollout.gpu_memory_utilization=0.05",
                 "resharding.bucket_mb=4096"]
    pool = build_plan(cluster(*overrides), gpu_memory_gib=80).pools[0]
    weights = rank_parameters(TINY_QWEN2, tp=2).total * 2 + rank_parameters(TINY_QWEN2).total * 2
    assert pool.peak.name == "weight sync" and pool.memory_bytes == weights + 4 * GIB + GRAPHS
    assert pool.phases[1].bytes == int(0.05 * 80 * GIB)  # generation: 4 GiB
    with pytest.raises(ConfigError) as err:
        build_plan(cluster(*overrides), gpu_memory_gib=4)  # the graphs: at most the 0.2 GiB share
    message = str(err.value)
    assert "The actor pool needs ~4.2 GiB per GPU in weight sync (actor weights" in message
    assert "buckets 4.0 GiB, resharding.bucket_mb + CUDA graphs 0.2 GiB, of the sleeping engine)" in message
    for key in ("resharding.bucket_mb=4096 lower", "rollout.tensor_parallel_size=1 higher",
                "actor.tensor_model_parallel_size=2 / actor.pipeline_model_parallel_size=1 higher", "trainer.nnodes"):
        assert key in message, key
    assert "max_tokens_per_micro_batch" not in message and "gpu_memory_utilization" not in message
    # Training over the GPU too (3.2 GiB of activations): the keys of both phases.
    activations = ["actor.max_tokens_per_micro_batch=1000000", "actor.sequence_parallel=false"]
    with pytest.raises(ConfigError, match="needs ~4.3 GiB per GPU in weight sync .*; training ~3.5 GiB too, .*"
                                          "resharding.bucket_mb=4096 lower.*actor.max_tokens_per_micro_batch=1000000 "
                                          "lower"):
        build_plan(cluster(*overrides[:1], "rollout.gpu_memory_utilization=0.1", overrides[2], *activations),
                   gpu_memory_gib=3)
    # Generation over the GPU: the whole GPU to the engine beside the reference's weights that stay there.
    with pytest.raises(ConfigError, match="in generation .*rollout.gpu_memory_utilization=1.0 lower.*"
                                          "ref.param_offload=false to true"):
        build_plan(cluster("actor.use_kl_loss=true", "ref.param_offload=false", "rollout.gpu_memory_utilization=1.0"),
                   gpu_memory_gib=80)


def test_actor_activations_in_the_plan_by_hand():
    """The demo's tiny Qwen2 (h 64, 2 layers, 2 heads of 32 = 2 kv heads, FFN 128, vocabulary 18) at TP 2 with
    sequence parallelism, micro-batches of 4 samples of up to 8 + 1 tokens (36 tokens): a layer keeps
    2 * (4*64/2 + (3*64 + 3*64)/2 + 5*128/2) = 1280 bytes per token; the update's head 2 * 2*64/2 + 9 * (2 + 8)."""
    plan = build_plan(cluster("actor.tensor_model_parallel_size=2"), gpu_memory_gib=80)
    actor = plan.pools[0].roles[0]
    assert actor.activations.update == 36 * (2 * 1280 + 128 + 90) and actor.activations.forward == 36 * 1280
    # The same through the module's own entry point, from the config.json and the actor's keys.
    passes = RolePasses(tokens=36, row_tokens=36, tp=2, sequence_parallel=True)
    assert actor.activations == activation_bytes(ModelShape.of(TINY_QWEN2), passes)
    # A token budget and full recompute: 2 layer inputs of 64 bytes, one layer remade (1280 > the head's 218).
    budget = build_plan(cluster("actor.tensor_model_parallel_size=2", "actor.max_tokens_per_micro_batch=1000",
                                "actor.recompute_granularity=full", "actor.recompute_method=uniform",
                                "actor.recompute_num_layers=1"), gpu_memory_gib=80).pools[0].roles[0]
    assert budget.activations.update == 1000 * (2 * 64 + 1280)
    assert "1000 tokens per micro-batch, full recompute (uniform: groups of 1 layer(s))" in budget.activation_note
    # sequence_parallel=false: the norms' 4h whole on both TP ranks (+ 2 * 128 bytes a layer), and the head's
    # inputs (+ 128).
    whole = build_plan(cluster("actor.tensor_model_parallel_size=2", "actor.sequence_parallel=false"),
                       gpu_memory_gib=80).pools[0].roles[0]
    assert whole.activations.update == 36 * (2 * (1280 + 256) + 256 + 90)
    # A budget below the longest sample (8 + 1 tokens): that sample runs alone, 9 tokens.
    short = build_plan(cluster("actor.tensor_model_parallel_size=2", "actor.max_tokens_per_micro_batch=4"),
                       gpu_memory_gib=80).pools[0].roles[0]
    assert short.activations.tokens == 9
    # CPU slots (torch's layers, layer_memory.py), sequence parallelism set (unset, a dense model has none on CPU,
    # models.activations.sequence_parallel_on): the norms keep their input and the normalized input in fp32, 2 *
    # (8 + 2) * 64/2 = 640, and the unfused RoPE its tables, 2 * 4 * 32 = 256 a token of a packed row; packed rows
    # attend per sample with torch's fused kernel, which keeps its copies of Q, K, V and its output, 2 * 4 * 32,
    # beside the output projection's input 2 * 32, instead of the QKV output and RoPE's Q and K; the head's norm
    # 10 * 64/2 = 320.
    sp = ("actor.tensor_model_parallel_size=2", "actor.sequence_parallel=true")
    cpu = build_plan(cluster(*sp), on_gpu=False).pools[0].roles[0]
    unset = build_plan(cluster("actor.tensor_model_parallel_size=2"), on_gpu=False).pools[0].roles[0]
    assert "sequence parallel" in cpu.activation_note and "sequence parallel" not in unset.activation_note
    assert cpu.activations.update == 36 * (2 * (640 + 256 + 64 + 256 + 640) + 320 + 90)
    # Right-padded rows (4 of 9 tokens share RoPE's tables: 64) go through Megatron's local attention, which keeps
    # the QKV output and RoPE's Q and K, 2 * (96 + 32 + 32), and the fp32 softmax and its bf16 copy over rows of 9
    # tokens, one head per rank (9 * 6).
    padded = build_plan(cluster(*sp, "actor.sequence_packing=false"), on_gpu=False).pools[0].roles[0]
    assert padded.activations.update == 36 * (2 * (640 + 64 + 64 + 320 + 54 + 640) + 320 + 90)
    budget_padded = build_plan(cluster("actor.tensor_model_parallel_size=2", "actor.sequence_packing=false",
                                       "actor.max_tokens_per_micro_batch=100"), on_gpu=False).pools[0].roles[0]
    assert "100 tokens per micro-batch (right-padded: padding not counted)" in budget_padded.activation_note


def test_a_plan_over_the_gpus_memory_is_refused_naming_the_keys(monkeypatch):
    monkeypatch.delenv("GPU_MEMORY_GIB", raising=False)
    # 1M tokens per micro-batch without sequence parallelism: 2 * (1280 + 256) + 256 + 90 = 3418 bytes a token
    # (3.2 GiB of activations per GPU), over a 2 GiB GPU.
    overrides = ["actor.tensor_model_parallel_size=2", "actor.max_tokens_per_micro_batch=1000000",
                 "actor.sequence_parallel=false", "rollout.gpu_memory_utilization=0.1"]
    described = build_plan(cluster(*overrides), gpu_memory_gib=2, refuse_over_memory=False)
    assert described.pools[0].activation_bytes == 3418 * 10 ** 6 and described.warnings
    with pytest.raises(ConfigError) as err:
        build_plan(cluster(*overrides), gpu_memory_gib=2)
    message = str(err.value)
    # The training phase is over (the engine asleep, its graphs in what its 0.2 GiB share leaves beside its weights).
    assert "The actor pool needs ~3.4 GiB per GPU in training" in message
    assert "more than the GPU's 2 GiB (measured)" in message
    assert "activations 3.2 GiB, the actor's update pass" in message
    for key in ("actor.max_tokens_per_micro_batch=1000000 lower", "actor.recompute_granularity=null to full",
                "actor.tensor_model_parallel_size=2 / actor.pipeline_model_parallel_size=1 higher",
                "actor.context_parallel_size=1 higher", "actor.sequence_parallel=false to true", "trainer.nnodes"):
        assert key in message, key
    assert "rollout.gpu_memory_utilization" not in message  # the engine's share is not on the GPU in training
    # Full recompute brings it under 2 GiB.
    assert build_plan(cluster(*overrides, "actor.recompute_granularity=full", "actor.recompute_method=uniform",
                                "actor.recompute_num_layers=1"), gpu_memory_gib=2)
    # GPU_MEMORY_GIB is a known size too.
    monkeypatch.setenv("GPU_MEMORY_GIB", "2")
    with pytest.raises(ConfigError, match="more than the GPU's 2 GiB [(]GPU_MEMORY_GIB[)]"):
        build_plan(cluster(*overrides))
    # An assumed size (no nvidia-smi, no GPU_MEMORY_GIB) warns instead, and says how to make it count.
    monkeypatch.delenv("GPU_MEMORY_GIB")
    huge = [*overrides[:1], "actor.max_tokens_per_micro_batch=100000000", *overrides[2:]]
    text = format_plan(cluster(*huge))
    assert "WARNING: the actor pool needs" in text and "Set GPU_MEMORY_GIB" in text
    # CPU slots are never refused.
    assert "WARNING" not in format_plan(cluster(*huge), gpu_memory_gib=2, on_gpu=False)


def test_context_parallelism_in_the_plan():
    """CP ranks come out of DP (16 GPUs at TP 2 x CP 2: DP 4), the distributed optimizer shards over DP x CP (8),
    and each rank computes half of every micro-batch's tokens."""
    cfg = cluster("actor.tensor_model_parallel_size=2", "actor.context_parallel_size=2")
    actor = build_plan(cfg, gpu_memory_gib=80).pools[0].roles[0]
    assert actor.layout == "TP=2 PP=1 CP=2 EP=1 DP=4" and "distributed optimizer over DP x CP=8" in actor.memory_note
    per_rank = rank_parameters(TINY_QWEN2, tp=2)
    assert actor.memory_bytes == int(per_rank.total * (6 + 12 / 8))
    assert actor.activations.tokens == 18 and actor.activations.update == 18 * (2 * 1280 + 128 + 90)
    assert "36 / CP=2 tokens per micro-batch" in actor.activation_note
    assert "TP x CP group (4 GPUs share a sequence) inside one node" in format_plan(cfg, gpu_memory_gib=80)


@pytest.mark.parametrize("overrides, key, fix", [
    # TP group larger than a node, and one that straddles two nodes
    (["trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=2", "actor.micro_batch_size=8"],
     "actor.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=1"),
    (["trainer.n_gpus_per_node=3", "actor.tensor_model_parallel_size=2", "rollout.n=3", "actor.micro_batch_size=1"],
     "actor.tensor_model_parallel_size=2", "divides 3"),
    # 3 nodes x 2 GPUs in 2 stages of 3: the stage boundary splits node 1
    (["trainer.nnodes=3", "trainer.n_gpus_per_node=2", "actor.tensor_model_parallel_size=1",
      "actor.pipeline_model_parallel_size=2", "rollout.n=3", "actor.micro_batch_size=1"],
     "actor.pipeline_model_parallel_size=2", "among 1, 3, 6"),
    # a vLLM engine straddling two nodes (over whole nodes it is allowed: below)
    (["trainer.n_gpus_per_node=3", "actor.tensor_model_parallel_size=1", "rollout.tensor_parallel_size=2",
      "rollout.n=3", "actor.micro_batch_size=1"],
     "rollout.tensor_parallel_size=2", "divides 3"),
])
def test_layouts_that_do_not_fit_the_nodes_name_the_key_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        build_plan(cluster(*overrides))
    assert key in str(err.value) and fix in str(err.value)


def test_an_engine_over_whole_nodes_is_placed_with_a_note(tmp_path):
    """For weights one node cannot hold (DeepSeek-V3 in bf16), an engine may span whole nodes: 2 nodes of 1 GPU. One
    that would share a node with the next engine is refused (12 of 16 heads' GPUs over nodes of 8)."""
    plan = format_plan(cluster("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1",
                               "rollout.tensor_parallel_size=2", "actor.micro_batch_size=8"), gpu_memory_gib=80)
    assert "TP=2, 1 engines" in plan and "each vLLM engine (2 GPUs) spans 2 whole nodes" in plan
    config = json.load(open("configs/models/tiny-qwen2-digits/config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 12, "num_key_value_heads": 12,
                                                      "head_dim": 32}))  # a size vLLM's CPU attention takes
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text(open(f"configs/models/tiny-qwen2-digits/{name}").read())
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=12 .* a multiple of 8 \\(whole nodes"):
        build_plan(cluster(f"model.path={tmp_path}", "trainer.nnodes=3", "rollout.tensor_parallel_size=12",
                           "actor.tensor_model_parallel_size=1", "rollout.n=3", "actor.micro_batch_size=1"))


def test_hostlist_simple_forms():
    assert expand_hostlist("node[01-04]") == ["node01", "node02", "node03", "node04"]
    assert expand_hostlist("a,b") == ["a", "b"]
    assert expand_hostlist("gpu[1,3-4]-ib,cpu5") == ["gpu1-ib", "gpu3-ib", "gpu4-ib", "cpu5"]
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        expand_hostlist("rack[1-2]-n[1-2]")


def test_node_role_from_torchrun_and_slurm_variables():
    torchrun = detect_node({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "h0", "GPUS_PER_NODE": "8"})
    assert (torchrun.node_rank, torchrun.nnodes, torchrun.head_address, torchrun.gpus) == (3, 4, "h0", 8)
    slurm = detect_node({"SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
                         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "4"})
    assert (slurm.node_rank, slurm.nnodes, slurm.head_address, slurm.gpus) == (1, 2, "gpu07", 4)
    with pytest.raises(LaunchError, match="ntasks-per-node=1"):
        detect_node({"SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_PROCID": "0"})
    with pytest.raises(LaunchError, match="NODE_RANK is not set"):
        detect_node({"NNODES": "2"})
    single = detect_node({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert (single.node_rank, single.nnodes, single.gpus) == (0, 1, 2)


def test_environment_disagreeing_with_config_names_the_key():
    env = detect_node({"NNODES": "3", "NODE_RANK": "0", "MASTER_ADDR": "h0", "GPUS_PER_NODE": "8"})
    with pytest.raises(LaunchError, match=r"needs 2 .*trainer.nnodes=2.*trainer.nnodes=3"):
        check_environment(env, 2, 8, "trainer.nnodes=2")
    with pytest.raises(LaunchError, match="must be below the node count 2"):
        check_environment(detect_node({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h0"}), 2, 8, "")
    with pytest.raises(LaunchError, match="trainer.n_gpus_per_node=8"):
        check_environment(env, 3, 16, "trainer.nnodes=3")
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        check_environment(detect_node({"NNODES": "2", "NODE_RANK": "1"}), 2, 8, "")


def test_cluster_shortfall_names_joined_and_expected():
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 64.0, "GPU": 8.0}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 64.0, "GPU": 8.0}}]
    assert cluster_shortfall(nodes, 2, 16) == "1 of 2 nodes and 8 of 16 GPUs have joined (joined: 10.0.0.1)"
    assert cluster_shortfall(nodes[:1], 1, 8) is None


def test_wait_for_head_sees_a_listening_port_and_times_out_on_a_closed_one():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accept = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    accept.start()
    wait_for_head("127.0.0.1", port, timeout_s=5)
    server.close()
    with closed_port() as closed:
        assert not port_open("127.0.0.1", closed)
        with pytest.raises(LaunchError, match="did not come up within 0.2 s"):
            wait_for_head("127.0.0.1", closed, timeout_s=0.2, poll_s=0.1)


def test_ray_auth_is_on_by_default_and_takes_the_token_where_ray_would(tmp_path):
    default = ray_auth({}, str(tmp_path / "run"))
    assert default.exports() == ["RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={tmp_path}/run/ray_auth_token"]
    given = ray_auth({"RAY_AUTH_TOKEN_PATH": "~/shared/token"}, "run")
    assert given.token_file == os.path.expanduser("~/shared/token") and "(RAY_AUTH_TOKEN_PATH;" in given.source
    in_env = ray_auth({"RAY_AUTH_TOKEN": "s3cret", "RAY_AUTH_TOKEN_PATH": "/x"}, "run")  # Ray's precedence
    assert in_env.exports() == ["RAY_AUTH_MODE=token"] and "s3cret" not in in_env.source
    off = ray_auth({"RAY_AUTH_MODE": "disabled"}, "run")
    assert off.exports() == ["RAY_AUTH_MODE=disabled"] and "insecure" in off.source
    with pytest.raises(LaunchError, match="RAY_AUTH_MODE='tokn'"):
        ray_auth({"RAY_AUTH_MODE": "tokn"}, "run")


def test_token_file_is_the_owners_only_kept_across_launches_and_refused_when_others_can_read_it(tmp_path):
    path = tmp_path / "run" / "ray_auth_token"
    write_token_file(str(path))
    token = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) == 64
    assert os.listdir(path.parent) == ["ray_auth_token"]  # no partial file left
    write_token_file(str(path))  # the same command again (a resumed run) keeps the token
    assert path.read_text() == token
    path.chmod(0o644)
    with pytest.raises(LaunchError, match="can be read by other users .*chmod 600"):
        write_token_file(str(path))


def test_wait_for_head_waits_for_the_token_file_too(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)  # the kernel completes the probes' connections: no accept needed
    port, token = server.getsockname()[1], tmp_path / "ray_auth_token"
    with pytest.raises(LaunchError, match="token file .* missing or empty on this node after 0.2 s"):
        wait_for_head("127.0.0.1", port, timeout_s=0.2, poll_s=0.1, token_file=str(token))
    token.write_text("0" * 64)
    wait_for_head("127.0.0.1", port, timeout_s=5, poll_s=0.1, token_file=str(token))
    server.close()


def test_opt_out_and_dashboard_host_reach_the_plan_and_the_script(monkeypatch, tmp_path):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_PORT", "RAY_DASHBOARD_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"NNODES": "1", "NODE_RANK": "0", "GPUS_PER_NODE": "2", "RAY_AUTH_MODE": "disabled",
                        "RAY_DASHBOARD_HOST": "0.0.0.0"}.items():
        monkeypatch.setenv(name, value)
    launch = plan_node(DEMO, [f"trainer.log_dir={tmp_path}"])
    described, script = describe_node(launch), shell_assignments(launch)
    assert "Ray authentication: OFF (RAY_AUTH_MODE=disabled) - insecure" in described
    assert "--dashboard-host=0.0.0.0 --dashboard-port=8265" in described and "dashboard 0.0.0.0:8265" in described
    assert "RAY_ENV=(RAY_AUTH_MODE=disabled)" in script and "TOKEN_FILE=''" in script


def test_separate_rollout_engines_get_a_pool_after_the_actors_nodes():
    cfg = cluster("rollout.placement=separate", "rollout.nnodes=1", "rollout.n_gpus_per_node=8",
                  "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.9")
    plan = build_plan(cfg, gpu_memory_gib=80)
    assert [(pool.name, pool.first_node, pool.world) for pool in plan.pools] == [("actor", 0, 16), ("rollout", 2, 8)]
    assert [role.name for role in plan.pools[0].roles] == ["actor"]
    engines = plan.pools[1].roles[0]
    assert engines.layout == "TP=2, 4 engines" and engines.memory_bytes == int(0.9 * 80 * 2 ** 30)
    assert "node 2: rollout pool, 1 x 8 = 8 GPUs" in format_plan(cfg, gpu_memory_gib=80)


def test_worker_pools_are_the_plans_pools_with_each_roles_layout(tiny_model_dir):
    """The trainer's worker groups and the printed plan come from the same pools."""
    cfg = cluster("actor.tensor_model_parallel_size=2", "actor.use_kl_loss=true", "model.random_init=false",
                  f"model.path={tiny_model_dir}",  # separate reference workers load the model's weights
                  "ref.placement=separate",
                  "ref.nnodes=1", "ref.n_gpus_per_node=4", "ref.tensor_model_parallel_size=1",
                  "rollout.placement=separate", "rollout.nnodes=1", "rollout.n_gpus_per_node=8")
    pools = worker_pools(cfg)
    assert [(p.name, p.roles, p.nnodes, p.gpus_per_node) for p in pools] == [
        ("actor", ("actor",), 2, 8), ("rollout", ("rollout",), 1, 8), ("ref", ("ref",), 1, 4)]
    assert pools[0].layout == {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": 2}  # expert TP defaults to TP
    assert pools[2].layout == {"tp": 1, "pp": 1} and pools[2].nodes_key == "ref.nnodes"
    plan = build_plan(cfg, gpu_memory_gib=80)
    assert [(pool.name, [role.name for role in pool.roles]) for pool in plan.pools] == [(p.name, list(p.roles))
                                                                                         for p in pools]
    assert [pool.first_node for pool in plan.pools] == [0, 2, 3]
    # Colocated (the default): the engines and the colocated roles live in the actor's workers.
    assert worker_pools(cluster("actor.use_kl_loss=true"))[0].roles == ("actor", "rollout", "ref")
    # A validation-only run generates and scores: no reference or critic, wherever they would be placed.
    assert [p.roles for p in worker_pools(cluster("actor.use_kl_loss=true", "algorithm.adv_estimator=gae",
                                                  "trainer.val_only=true"))] == [
        ("actor", "rollout")]
