"""A tiny Qwen3-Next (a Gated DeltaNet layer, then a gated full-attention layer; zero-centred norms; a gated shared
expert beside 4 routed ones) on gloo: Megatron's log-probs against transformers' Qwen3NextForCausalLM in float32,
with the samples packed into one row (the linear attention confined to each by cu_seqlens) and in right-padded rows
alike, at TP=1, TP=2 (sequence parallel, as MoE layers need there), PP=2 and EP=2, and Qwen3.5's (Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM) at TP=1 and TP=2 (the MoE one at PP=2 and EP=2 too); one update of each against
transformers' and at TP=2 (the MoE ones at TP=2 x EP=2) against one rank; its HF export bitwise the folder's tensors
(Qwen3.5's too), and through a Megatron checkpoint saved at one layout and converted back at another; its weights
(Qwen3.5's too) synced into real vLLM engines (the Gated DeltaNet core computed in torch on CPU:
rollout/cpu_gated_delta.py) bit for bit, which then generate as transformers does; and the doctor's model checks on
each."""
import dataclasses

import pytest
import torch

from helpers.parity import config, family_model_dir, hf_model, hf_reference, hf_update_reference, make_batch
from helpers.ranks import build_actor, check_engines_hold_the_trainer_weights, saved_checkpoint, update_and_export
from helpers.worlds import run_distributed
from rl_megatron.convert import main as convert
from rl_megatron.doctor.model_checks import run_checks
from rl_megatron.doctor.report import PASS, SKIP

TOLERANCE = 1e-4  # float32 log-probs against transformers, as every family
PACKED_TOLERANCE = 1e-5  # a packed row against right-padded rows, on the same ranks


def packed_and_padded(cfgs, batch):
    """The log-probs of `batch` under each config (packed rows, then padded ones), and the HF export."""
    outputs = []
    for cfg in cfgs:
        actor = build_actor(cfg)
        outputs.append(actor.log_probs(batch))
    return outputs, actor.hf_state_dict()


def expert_parallel(tp: int, pp: int, ep: int) -> dict:
    """The config keys of `ep` data-parallel ranks splitting the experts, on tp * pp * ep devices."""
    return {"actor.expert_model_parallel_size": ep, "trainer.n_gpus_per_node": tp * pp * ep}


# PP=2 over 4 layers: each stage a linear-attention layer, then a full-attention one. Qwen3.5 (dense and MoE: the
# same hybrid, its linear attention's input projection stored in four tensors) at TP=1 and TP=2, and the MoE one at
# PP=2 too. The MoE models at EP=2 (2 of the 4 experts on each of 2 data-parallel ranks; the shared expert whole on
# each), Qwen3-Next with TP=2 inside each expert-parallel rank as well.
@pytest.mark.parametrize("model_type,tp,pp,ep", [
    ("qwen3_next", 1, 1, 1), ("qwen3_next", 2, 1, 1), ("qwen3_next", 1, 2, 1),
    *((qwen3_5, tp, 1, 1) for qwen3_5 in ("qwen3_5_text", "qwen3_5_moe_text") for tp in (1, 2)),
    ("qwen3_5_moe_text", 1, 2, 1), ("qwen3_next", 2, 1, 2), ("qwen3_5_moe_text", 1, 1, 2)])
def test_log_probs_packed_and_padded_and_export_match_transformers(tmp_path, model_type, tp, pp, ep):
    model_dir = family_model_dir(tmp_path / model_type, model_type, tied=False, layers=2 * pp)
    # Four samples a micro-batch: a packed row holds four spans.
    cfgs = [config(model_dir, tp, pp, **{"actor.sequence_packing": packing, "actor.micro_batch_size": 4},
                   **expert_parallel(tp, pp, ep)) for packing in (True, False)]
    batch = make_batch()
    results = run_distributed(packed_and_padded, tp * pp * ep, tp, pp, ep=ep, args=(cfgs, batch))
    ref_log_probs, ref_entropy, _ = hf_reference(model_dir, batch, cfgs[0].rollout.temperature)
    mask = batch.response_mask.bool()
    # Ranks in Megatron's order (TP fastest, then data = expert parallel, then PP): each data-parallel rank's first
    # TP rank on the last stage returns the outputs, rank 0 the export.
    last_stage = (pp - 1) * tp * ep
    for packed, padded in (results[last_stage + dp * tp][0] for dp in range(ep)):
        for outputs in (packed, padded):
            assert (outputs.log_probs[mask] - ref_log_probs[mask]).abs().max() <= TOLERANCE
            assert (outputs.entropy[mask] - ref_entropy[mask]).abs().max() <= TOLERANCE
        assert (packed.log_probs[mask] - padded.log_probs[mask]).abs().max() <= PACKED_TOLERANCE
    exported, saved = results[0][1], saved_checkpoint(model_dir)
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


# Each family's linear attention as its folders store it: Qwen3-Next's input projection in two tensors of grouped
# key heads, Qwen3.5's in four flat ones.
LINEAR_ATTENTION_TENSORS = {
    "qwen3_next": ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    "qwen3_5_text": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
}
LINEAR_ATTENTION_TENSORS["qwen3_5_moe_text"] = LINEAR_ATTENTION_TENSORS["qwen3_5_text"]


# The MoE models at TP=2 x EP=2 (4 ranks: each of 2 data-parallel ranks updates on its half of the batch and holds
# 2 of the 4 experts, split over its 2 TP ranks; the attention's and the shared expert's gradients summed over both).
@pytest.mark.parametrize("model_type,ep", [("qwen3_next", 2), ("qwen3_5_text", 1), ("qwen3_5_moe_text", 2)])
def test_grpo_update_matches_transformers_and_tp2_equals_tp1(tmp_path, model_type, ep):
    """One update: the gradient norm transformers computes for the same loss, the same update at TP=2 (its linear
    attention's heads and norm gradients split over the ranks) as on one rank, and the linear attention trained
    (and the MoE models' routers and experts)."""
    model_dir = family_model_dir(tmp_path / model_type, model_type, tied=False)
    batch = make_batch()
    lr = {"actor.optim.lr": 1e-5}
    one = config(model_dir, 1, 1, **lr)
    ref_metrics, ref_state = run_distributed(update_and_export, 1, args=(one, batch))[0]
    log_probs, _, _ = hf_reference(model_dir, batch, one.rollout.temperature)
    _, hf_grad_norm = hf_update_reference(hf_model(model_dir), dataclasses.replace(batch, old_log_probs=log_probs), one)
    assert ref_metrics["actor/grad_norm"] == pytest.approx(hf_grad_norm, rel=1e-4)
    cfg = config(model_dir, 2, 1, **lr, **expert_parallel(2, 1, ep))
    metrics, state = run_distributed(update_and_export, 2 * ep, 2, ep=ep, args=(cfg, batch))[0]
    assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-6
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-5)
    assert set(state) == set(ref_state)
    assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-5
    initial = saved_checkpoint(model_dir)
    trained = [f"model.layers.0.linear_attn.{name}" for name in (*LINEAR_ATTENTION_TENSORS[model_type],
                                                                 "conv1d.weight", "A_log", "dt_bias", "norm.weight")]
    if ep > 1:  # every routed expert's tensors (a top-2 of 4 over the batch's 96 positions reaches each), the router's
        trained += [name for name in initial if ".mlp.experts." in name or name.endswith(".mlp.gate.weight")]
    for name in trained:
        assert not torch.equal(initial[name], state[name]), f"the update left {name} unchanged"


def test_checkpoint_round_trip_at_another_layout_is_bitwise(tmp_path):
    hf_dir = family_model_dir(tmp_path / "hf", "qwen3_next", tied=False, layers=4)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert convert(["from-hf", "--hf", hf_dir, "--out", ckpt, "--tp", "2"]) == 0
    assert convert(["to-hf", "--ckpt", ckpt, "--out", out, "--pp", "2"]) == 0
    original, exported = saved_checkpoint(hf_dir), saved_checkpoint(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


# One engine per rank, and one engine over both ranks: its key heads (Qwen3-Next's in_proj_qkvz, in_proj_ba; each
# part of Qwen3.5's four tensors), each section of the convolution's channels, A_log and dt_bias split over the
# engine's TP ranks, as the gated attention's query heads.
@pytest.mark.parametrize("model_type,tp,engine_tp", [("qwen3_next", 1, 1), ("qwen3_next", 2, 2),
                                                     ("qwen3_5_text", 1, 1), ("qwen3_5_text", 2, 2),
                                                     ("qwen3_5_moe_text", 1, 1), ("qwen3_5_moe_text", 2, 2)])
def test_engines_hold_the_trainer_weights_and_generate_as_transformers(tmp_path, model_type, tp, engine_tp):
    model_dir = family_model_dir(tmp_path / model_type, model_type, tied=False)
    check_engines_hold_the_trainer_weights(model_dir, tp, 1, 1, 1, engine_tp, "auto")


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_the_doctors_model_checks_pass_on_the_hybrids(model_type):
    """`python -m rl_megatron.doctor` with a hybrid's model.path: its router (none in the dense Qwen3.5: skipped),
    log-probs and export against transformers, an update, the offload round trip and `bench train` pass."""
    results = {r.name: r for r in run_distributed(run_checks, 1, args=(model_type, False))[0]}
    assert results["stack: MoE router"].status == (SKIP if model_type == "qwen3_5_text" else PASS)
    for name in (f"Megatron vs transformers ({model_type})", "update", "offload round trip", "bench train"):
        assert results[name].status == PASS, results[name]
