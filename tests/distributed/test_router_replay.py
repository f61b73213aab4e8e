"""MoE routing replay (actor.router_replay) on a tiny Qwen3-MoE (4 experts, top-2) on gloo, at TP=1 and TP=2.
R2: the old log-prob pass records each token's experts as the routers chose them; a forward pass replaying given
experts uses exactly those, and its log-probs equal transformers' forced through the same experts; the update
replaying the recorded routing goes through the recorded experts and computes what the update without replay
computes (the same weights route the same way), to rounding. R3: the old log-prob, reference and update passes go
through the engine's experts, and moe/routing_agreement counts where the routers' own choice holds them."""
import numpy as np
import pytest
import torch

from helpers.parity import config, family_model_dir, hf_model, make_batch
from helpers.ranks import PROMPTS, engine_routing_replayed, routing_replay_passes, update_and_export
from helpers.routing import (TOP_K, check_r3_passes, forced_routing, hf_forced_log_probs, r2_record_and_update,
                             top_k_sets)
from helpers.worlds import run_distributed
from rl_megatron.doctor.parity import hf_token_log_probs
from rl_megatron.models.router_replay import model_layout

@pytest.mark.parametrize("packing", [True, False])
def test_r2_records_replays_and_matches_a_forced_reference(tmp_path, packing):
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False, norm_topk_prob=True)
    settings = {"actor.optim.lr": 1e-3, "trainer.n_gpus_per_node": 1, "actor.sequence_packing": packing}
    batch = make_batch()
    forced = forced_routing(batch)
    cfg = config(model_dir, 1, 1, **settings, **{"actor.router_replay": "R2"})
    old, recorded_choices, forced_log_probs, forced_choices, update_choices, metrics, weights, micros = \
        run_distributed(routing_replay_passes, 1, args=(cfg, batch, forced))[0]
    lengths = batch.sequence_lengths()
    real = torch.arange(batch.input_ids.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)

    # The record: per sample, each real token's experts in each layer, compact, as the routers chose them.
    routing = old.routed_experts
    assert routing.dtype == torch.int16 and routing.shape == (*batch.input_ids.shape, 2, TOP_K)
    assert (routing[~real] == 0).all()
    own = [top_k_sets(choice) for choice in recorded_choices]  # micro-batch by micro-batch, layer by layer
    assert len(own) == 2 * len(micros)
    per_router = [(micro, layer) for micro in micros for layer in range(2)]  # the order the routers ran in
    for choice, (micro, layer) in zip(own, per_router):  # the record, laid out as those micro-batches were
        real_here = _flat_real(micro)
        assert torch.equal(choice[real_here], _laid_sorted(micro, routing, layer)[real_here])

    # Replaying given experts: the routers used exactly those, and the log-probs are transformers' through them.
    assert len(forced_choices) == len(per_router)
    for choice, (micro, layer) in zip(forced_choices, per_router):
        real_here = _flat_real(micro)
        assert torch.equal(top_k_sets(choice)[real_here], _laid_sorted(micro, forced, layer)[real_here])
    reference = hf_forced_log_probs(model_dir, batch, forced, cfg.rollout.temperature)
    mask = batch.response_mask.bool()
    assert (forced_log_probs[mask] - reference[mask]).abs().max() <= 1e-5
    plain_reference = hf_token_log_probs(hf_model(model_dir), batch.input_ids, cfg.rollout.temperature)[0]
    assert (old.log_probs[mask] - reference[mask]).abs().max() > 1e-3  # forcing changed them: the test can fail

    # The update replayed the record: its routers went through the recorded experts, and replaying a pass's own
    # routing changes nothing (the same weights route the same way): metrics and weights as without replay.
    assert update_choices and all(c.sum(1).eq(TOP_K).all() for c in update_choices)
    plain_cfg = config(model_dir, 1, 1, **settings)
    plain_metrics, plain_weights = run_distributed(update_and_export, 1, args=(plain_cfg, batch))[0]
    assert metrics["actor/pg_loss"] == plain_metrics["actor/pg_loss"]
    assert metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=1e-12)
    differences = max((weights[name] - plain_weights[name]).abs().max().item() for name in plain_weights)
    # Packed, the same to the bit. Right-padded rows' padding positions replay experts 0..k-1 instead of their own
    # choice: an expert's matrix product then holds other rows beside the real tokens' and may round those in the
    # last bit, which Adam's step scales up where a gradient is near zero (at most ~1e-5 here, at lr 1e-3).
    assert differences == 0 if packing else differences <= 1e-4
    assert (old.log_probs[mask] - plain_reference[mask]).abs().max() <= 1e-4


def _flat_real(micro) -> torch.Tensor:
    """`micro`'s real token positions as its routers see them (sequence-first, flattened)."""
    real = torch.zeros(micro.input_ids.shape, dtype=torch.bool)
    for i, length in enumerate(micro.lengths):
        row, start = (i, 0) if micro.cu_seqlens is None else (0, micro.cu_seqlens[i])
        real[row, start:start + length] = True
    return real.transpose(0, 1).reshape(-1)


def _laid_sorted(micro, routing, layer) -> torch.Tensor:
    """`routing` (per sample) as `micro`'s routers see layer `layer`: each token's experts, sorted."""
    return model_layout(micro, routing[micro.rows], TOP_K)[0][:, layer].sort(-1).values


def test_r3_replays_the_engines_routing_in_every_pass_and_measures_the_agreement(tmp_path):
    check_r3_passes(tmp_path, run_distributed, log_prob_tolerance=1e-5, agreement_tolerance=1e-12, exact=True)


@pytest.mark.parametrize("tp,pp,ep,packing", [(2, 2, 1, True), (1, 1, 2, False)])
def test_r3_replays_at_tensor_pipeline_and_expert_parallel_layouts(tmp_path, tp, pp, ep, packing):
    """TP=2 with sequence parallelism and PP=2 on packed rows (each stage replays its own layer's share of the
    tokens), and EP=2 (the experts split, each data-parallel rank its own rows): the same log-probs as transformers
    forced through the engine's experts, the update's forward the old pass's, and the agreement counted over the
    stages and ranks. The log-probs within fp32 rounding of another summation order: 1e-6 held on one Intel machine
    and 1.4e-6 was seen on an AMD EPYC, so the families' parity bound (1e-5) applies."""
    check_r3_passes(tmp_path, run_distributed, log_prob_tolerance=1e-5, agreement_tolerance=1e-12, exact=False,
                    tp=tp, pp=pp, ep=ep, **{"actor.sequence_packing": packing})


def test_r2_at_tensor_parallel_2_shares_each_micro_batchs_tokens_as_the_routers_see_them(tmp_path):
    """TP=2 with sequence parallelism (MoE at TP > 1): each rank's routers see their half of the tokens. The record
    gathers the halves (the same routing as one rank records), and the forced replay hands each rank its half."""
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False, norm_topk_prob=True)
    batch = make_batch()
    forced = forced_routing(batch)
    settings = {"actor.optim.lr": 1e-3, "actor.router_replay": "R2"}
    one = run_distributed(routing_replay_passes, 1, args=(
        config(model_dir, 1, 1, **settings, **{"trainer.n_gpus_per_node": 1}), batch, forced))[0]
    two = run_distributed(routing_replay_passes, 2, 2, args=(config(model_dir, 2, 1, **settings), batch, forced))[0]
    assert torch.equal(two[0].routed_experts, one[0].routed_experts)
    mask = batch.response_mask.bool()
    reference = hf_forced_log_probs(model_dir, batch, forced, 0.7)
    assert (two[2][mask] - reference[mask]).abs().max() <= 1e-5
    assert two[5]["actor/pg_loss"] == pytest.approx(one[5]["actor/pg_loss"], abs=1e-6)


@pytest.mark.parametrize("family,extra", [
    ("qwen3_moe", {}), ("deepseek_v3", {}), ("gpt_oss", {}),  # gpt-oss: its biased router, both layers routing
    ("qwen3_5_moe_text", {}),  # the hybrid: a Gated DeltaNet layer, then a gated attention one, each routing
    # The other routing families, on request (RL_MEGATRON_SLOW=1): the mechanism is the same for all.
    pytest.param("mixtral", {}, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", {"mlp_only_layers": [0]}, marks=pytest.mark.slow),  # with its shared expert
    pytest.param("deepseek_v2", {}, marks=pytest.mark.slow),
    pytest.param("glm4_moe", {}, marks=pytest.mark.slow),
    pytest.param("qwen3_next", {}, marks=pytest.mark.slow)])
def test_the_engines_routing_arrives_for_every_token_and_the_old_log_prob_pass_replays_it(tmp_path, family, extra):
    """A real vLLM engine (moe.engine_routing) on the model's weights: every completion carries the experts of every
    position it fed (prompt and response: P + R - 1 rows), for each MoE layer (a dense first layer, as DeepSeek's,
    has no column), as distinct valid ids; with actor.router_replay=R3 the old log-prob pass routes each of those
    positions through exactly those experts; on the same weights in fp32 the trainer's own routers agree with the
    engine's almost everywhere (replayed or not), and its log-probs are the engine's."""
    model_dir = family_model_dir(tmp_path / family, family, tied=False, **extra)
    cfg = config(model_dir, 1, 1, **{"trainer.n_gpus_per_node": 1, "actor.router_replay": "R3"})
    completions, batch, chosen, micros, metrics, log_probs, unreplayed = \
        run_distributed(engine_routing_replayed, 1, args=(cfg, PROMPTS, 5))[0]
    layers = len(chosen) // len(micros)  # the routing layers: the second only where the first is dense
    assert layers == (2 if family in ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "qwen3_next") else 1)
    for i, completion in enumerate(completions):
        routing = completion.routed_experts
        fed = len(PROMPTS[i // 2]) + len(completion.response_ids) - 1
        assert routing.dtype == np.int16 and routing.shape == (fed, layers, TOP_K)
        assert ((routing >= 0) & (routing < 4)).all()  # the tiny models' 4 experts
        assert (np.sort(routing, -1)[..., 1:] != np.sort(routing, -1)[..., :-1]).all()  # distinct per token
    assert len(chosen) == layers * len(micros)
    for choice, (micro, layer) in zip(chosen, [(m, layer) for m in micros for layer in range(layers)]):
        experts, routed = model_layout(micro, batch.routed_experts[micro.rows], TOP_K)
        assert routed.sum() == sum(length - 1 for length in micro.lengths)  # every position the engine fed
        assert torch.equal(top_k_sets(choice)[routed], experts[:, layer].sort(-1).values[routed])
    assert metrics["moe/routing_agreement"] >= 0.95
    # Unreplayed (actor.router_replay=disabled) the routers' own choices are measured too; the first MoE layer sees
    # the same hidden states either way.
    first = f"moe/layer{2 - layers}/routing_agreement"
    assert unreplayed["moe/routing_agreement"] >= 0.95 and unreplayed[first] == metrics[first]
    mask = batch.response_mask.bool()
    assert (log_probs[mask] - batch.rollout_log_probs[mask]).abs().max() <= 1e-4


def test_r2_at_pipeline_parallel_2_gathers_each_stages_record(tmp_path):
    """PP=2 (one MoE layer per stage): each stage records its own layer; after the pass the record holds both, the
    same as one rank's, and the update replaying it computes what one rank's does."""
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False, norm_topk_prob=True)
    batch = make_batch()
    settings = {"actor.optim.lr": 1e-3, "actor.router_replay": "R2"}
    one = run_distributed(r2_record_and_update, 1, args=(
        config(model_dir, 1, 1, **settings, **{"trainer.n_gpus_per_node": 1}), batch))[0]
    two = run_distributed(r2_record_and_update, 2, 1, 2, args=(config(model_dir, 1, 2, **settings), batch))[0]
    assert torch.equal(two[0], one[0]) and (two[0][:, :, 1] != 0).any()  # the second stage's layer is there
    assert two[1]["actor/pg_loss"] == pytest.approx(one[1]["actor/pg_loss"], abs=1e-6)
    assert two[1]["actor/grad_norm"] == pytest.approx(one[1]["actor/grad_norm"], rel=1e-5)
