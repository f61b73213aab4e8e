"""A tiny Qwen3-MoE (4 experts, top-2) at expert parallelism on gloo: Megatron's log-probs and HF export against
transformers, and the trainer's experts resharded into real vLLM engines."""
import dataclasses

import psutil
import pytest
import torch

from helpers.parity import SEQ, config, family_model_dir, hf_reference, make_batch
from helpers.ranks import (actor_log_probs_everywhere, build_actor, check_engines_hold_the_trainer_weights,
                           log_probs_and_export, saved_checkpoint, update_and_export)
from rl_megatron.batch import TrainBatch
from helpers.worlds import run_distributed


def odd_length_batch() -> TrainBatch:
    """11 tokens, not a multiple of TP: sequence parallelism (MoE layers at TP 2) pads them and crops the outputs."""
    return make_batch(18).truncated(SEQ - 1)


# Qwen3-MoE's router without renormalisation (with it, Qwen's released models: test_experts_split_unlike_attention
# below); Mixtral always renormalises;
# Qwen2-MoE's gated shared expert after a dense first layer; DeepSeek-V3's latent attention, sigmoid router with its
# expert bias and groups, shared expert and dense first layer; DeepSeek-V2's softmax router, over pipeline stages;
# GLM-4.5's partial rotary, q/k norms and biases with the sigmoid router (tests/helpers/parity.py has their configs).
@pytest.mark.parametrize("family,tp,pp,ep,router", [("qwen3_moe", 2, 1, 2, {"norm_topk_prob": False}),
                                                    ("mixtral", 1, 1, 2, {}),
                                                    ("qwen2_moe", 2, 1, 2, {"mlp_only_layers": [0]}),
                                                    ("deepseek_v3", 2, 1, 2, {}), ("deepseek_v2", 1, 2, 1, {}),
                                                    ("glm4_moe", 2, 1, 2, {})])
def test_expert_parallel_log_probs_and_export_match_transformers(tmp_path, family, tp, pp, ep, router):
    model_dir = family_model_dir(tmp_path / "moe", family, tied=False, **router)
    cfg = config(model_dir, tp, pp, **{"actor.expert_model_parallel_size": ep, "trainer.n_gpus_per_node": tp * pp * ep})
    batch = odd_length_batch()
    results = run_distributed(log_probs_and_export, tp * pp * ep, tp, pp, ep=ep, args=(cfg, batch))
    ref_log_probs, ref_entropy, _ = hf_reference(model_dir, batch, cfg.rollout.temperature)
    mask = batch.response_mask.bool()
    last_stage = (pp - 1) * tp * ep  # ranks in Megatron's order: TP fastest, then data (= expert) parallel, then PP
    for owner in (results[last_stage + dp * tp][0] for dp in range(ep)):  # each data-parallel rank's first TP rank
        assert (owner.log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-4
        assert (owner.entropy[mask] - ref_entropy[mask]).abs().max() <= 1e-4
    exported, saved = results[0][1], saved_checkpoint(model_dir)
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("tp,ep", [(2, 2)])
def test_expert_parallel_grpo_update_equals_one_rank(tmp_path, tp, ep):
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False)
    batch = odd_length_batch()
    lr = {"actor.optim.lr": 1e-5, "trainer.n_gpus_per_node": 1}
    ref_metrics, ref_state = run_distributed(update_and_export, 1, args=(config(model_dir, 1, 1, **lr), batch))[0]
    cfg = config(model_dir, tp, 1, **dict(lr, **{"actor.expert_model_parallel_size": ep,
                                                 "trainer.n_gpus_per_node": tp * ep}))
    metrics, state = run_distributed(update_and_export, tp * ep, tp, ep=ep, args=(cfg, batch))[0]
    assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-6
    assert abs(metrics["actor/grad_norm"] - ref_metrics["actor/grad_norm"]) <= 1e-5
    assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-5
    initial = saved_checkpoint(model_dir)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        assert not torch.equal(initial[name], state[name]), f"the update left {name} unchanged"


# vLLM's engines of each family: Qwen2-MoE's shared expert and its gate, DeepSeek-V3's latent attention (vLLM remakes
# its decoding copies of kv_b_proj after each sync) and expert bias, GLM-4.5's.
@pytest.mark.parametrize("family,tp,ep,engine_tp", [("qwen2_moe", 1, 2, 1), ("qwen3_moe", 2, 2, 2), ("mixtral", 1, 2, 1),
                                                    ("deepseek_v3", 1, 2, 1), ("glm4_moe", 1, 2, 1),
                                                    pytest.param("deepseek_v2", 1, 2, 1, marks=pytest.mark.slow)])
def test_engines_hold_the_expert_parallel_trainer_weights_exactly(tmp_path, family, tp, ep, engine_tp):
    model_dir = family_model_dir(tmp_path / "moe", family, tied=False)
    check_engines_hold_the_trainer_weights(model_dir, tp, 1, 1, ep, engine_tp, "process_group")



def layout_parity_then_knobs_update(plain, knobs, batch):
    """Log-probs and HF export at the `plain` config; then, built at the `knobs` config from the same weights, one
    update: its metrics, and the weights before and after it as HF tensors."""
    actor = build_actor(plain)
    log_probs, exported = actor.log_probs(batch), actor.hf_state_dict()
    actor = build_actor(knobs)
    metrics = actor.update(dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch)))
    return log_probs, exported, metrics, actor.hf_state_dict()


def test_experts_split_unlike_attention_and_router_knobs(tmp_path):
    """Attention at TP=2, each expert whole (expert TP=1) on one of 2 expert-parallel ranks, in 2 processes: the
    log-probs match transformers and the export is bitwise the checkpoint (the weight table splits experts over the
    expert-TP group). Then one update with a frozen router, token dropping, fp64 routing and both router losses:
    the routers keep their weights, the experts move, and the router metrics count what the capacity allows."""
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False)
    batch = odd_length_batch()
    layout = {"actor.expert_model_parallel_size": 2, "actor.expert_tensor_parallel_size": 1, "actor.optim.lr": 1e-3}
    plain = config(model_dir, 2, 1, **layout)
    knobs = config(model_dir, 2, 1, **layout, **{"moe.freeze_router": True, "moe.capacity_factor": 0.5,
                                                  "moe.router_dtype": "fp64", "moe.aux_loss_coeff": 0.01,
                                                  "moe.z_loss_coeff": 0.001})
    results = run_distributed(layout_parity_then_knobs_update, 2, 2, ep=2, etp=1, args=(plain, knobs, batch))
    log_probs, exported, metrics, after = results[0]
    ref_log_probs, ref_entropy, _ = hf_reference(model_dir, batch, plain.rollout.temperature)
    mask = batch.response_mask.bool()
    assert (log_probs.log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-4
    assert (log_probs.entropy[mask] - ref_entropy[mask]).abs().max() <= 1e-4
    saved = saved_checkpoint(model_dir)
    assert set(exported) == set(saved) and all(torch.equal(exported[n], t) for n, t in saved.items())
    routers = [name for name in saved if name.endswith(".mlp.gate.weight")]
    assert routers and all(torch.equal(saved[name], after[name]) for name in routers)
    for layer in (0, 1):
        assert any(not torch.equal(saved[n], after[n]) for n in saved if f"layers.{layer}.mlp.experts." in n)
    assert results[1][2] == metrics  # reduced over the ranks: every rank reports the same
    # 8 sequences of 11 tokens, packed in pairs: 88 tokens x top-2 = 176 assignments per layer, in 8 router calls
    # (4 micro-batches of 22 tokens x 2 sequence-parallel shards) each letting an expert take a capacity of about
    # 11 x 2 / 4 x 0.5: many are dropped, not all.
    for layer in (0, 1):
        assert 0 < metrics[f"moe/layer{layer}/load_max"] <= 8 * 3
        assert 88 * 2 // 3 < metrics[f"moe/layer{layer}/dropped_tokens"] < 88 * 2
    for name in ("moe/load_balancing_loss", "moe/z_loss", "moe/layer1/z_loss", "moe/load_std"):
        assert metrics[name] > 0, name


def updates_around_a_checkpoint(cfg, batch, ckpt: str, save: bool):
    """save: one update, save the training state to `ckpt`, a second update. Otherwise: load `ckpt`, then the
    second update. Returns the second update's metrics and the weights after it."""
    from megatron.core import parallel_state

    actor = build_actor(cfg)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()

    def update():
        full = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
        return actor.update(full.split(dp)[rank])

    if save:
        update()
        actor.save_checkpoint(ckpt)
        # The torch_dist writer's results went through an in-process queue, not a spawned Manager's (checkpoint/
        # model.py): no process of multiprocessing's spawn is left beside this rank.
        helpers = [p.cmdline() for p in psutil.Process().children(recursive=True)
                   if "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert not helpers, helpers
    else:
        actor.load_checkpoint(ckpt)
    return update(), actor.hf_state_dict()


def test_training_state_resumes_at_another_expert_layout(tmp_path):
    """Saved at EP=2 (2 experts per rank), resumed at EP=4 (1 per rank, 4 ranks): Adam's moments and step come
    back resharded, so the next update is the one the original layout makes (a fresh optimizer's first Adam step
    would move every weight by about the learning rate instead)."""
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False)
    batch, ckpt = odd_length_batch(), str(tmp_path / "ckpt")

    def layout(ep):
        return config(model_dir, 1, 1, **{"actor.optim.lr": 1e-3, "trainer.n_gpus_per_node": ep,
                                          "actor.expert_model_parallel_size": ep})

    expected_metrics, expected = run_distributed(updates_around_a_checkpoint, 2, 1, ep=2,
                                                 args=(layout(2), batch, ckpt, True))[0]
    metrics, state = run_distributed(updates_around_a_checkpoint, 4, 1, ep=4,
                                     args=(layout(4), batch, ckpt, False))[0]
    assert abs(metrics["actor/pg_loss"] - expected_metrics["actor/pg_loss"]) <= 1e-6
    assert max((expected[name] - tensor).abs().max().item() for name, tensor in state.items()) <= 1e-5
