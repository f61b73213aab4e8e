"""gpt-oss on gloo against transformers: attention sinks, the window on every other layer (sequences longer than
it), biased experts whose clamped SwiGLU clamps (a quarter of the gate and up values of the test's weights), the
biased router; at TP=2 (sequence parallel), EP=2 and PP=2, packed and padded rows. Exports are the folder's own
stacked experts, bit for bit; a folder as released (MXFP4 experts) loads dequantized."""
import pytest
import torch

from helpers.mxfp4 import write_released
from helpers.parity import SEQ, config, family_model_dir, hf_model, hf_reference, hf_update_reference, make_batch
from helpers.ranks import check_engines_hold_the_trainer_weights, log_probs_and_export, update_and_export
from helpers.worlds import run_distributed
from rl_megatron.convert import main as convert
from rl_megatron.doctor.model_checks import run_checks
from rl_megatron.doctor.report import PASS
from rl_megatron.doctor.parity import saved_checkpoint
from rl_megatron.models.family import table_for
from rl_megatron.models.hf_config import read_hf_config


def stored(model_dir: str, state: dict) -> dict:
    """An exported per-expert state dict as the family's folders store it."""
    hf = read_hf_config(model_dir)
    return table_for(hf, hf["vocab_size"]).stored_tensors(state)


def test_the_window_and_the_clamp_act_on_the_test_batch(tmp_path):
    """What the parity tests below rely on: sequences longer than the window, and clamped expert activations."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    model_dir = family_model_dir(tmp_path, "gpt_oss", tied=False)
    assert SEQ > read_hf_config(model_dir)["sliding_window"]
    clamped = []
    original = modeling_gpt_oss.GptOssExperts._apply_gate

    def spy(self, gate_up):
        clamped.append(min((gate_up[..., ::2] > self.limit).float().mean(),
                           (gate_up[..., 1::2].abs() > self.limit).float().mean()).item())
        return original(self, gate_up)

    modeling_gpt_oss.GptOssExperts._apply_gate = spy
    try:
        hf_model(model_dir)(make_batch(18).input_ids)
    finally:
        modeling_gpt_oss.GptOssExperts._apply_gate = original
    assert clamped and min(clamped) > 0.05


# Expert-TP stays 1 (biased experts: models/checks.py), so TP=2 takes EP=2 (preflight/layout.py); PP=2 holds two
# layers a stage, one windowed and one not.
@pytest.mark.parametrize("tp,pp,ep,layers,packing", [(2, 1, 2, 2, True), (1, 1, 2, 2, False), (1, 2, 1, 4, True)])
def test_log_probs_and_export_match_transformers(tmp_path, tp, pp, ep, layers, packing):
    model_dir = family_model_dir(tmp_path, "gpt_oss", tied=False, layers=layers)
    cfg = config(model_dir, tp, pp, **{"actor.expert_model_parallel_size": ep, "actor.expert_tensor_parallel_size": 1,
                                      "actor.sequence_packing": packing, "trainer.n_gpus_per_node": tp * pp * ep})
    batch = make_batch(18)
    results = run_distributed(log_probs_and_export, tp * pp * ep, tp, pp, ep=ep, etp=1, args=(cfg, batch))
    ref_log_probs, ref_entropy, _ = hf_reference(model_dir, batch, cfg.rollout.temperature)
    mask = batch.response_mask.bool()
    last_stage = (pp - 1) * tp * ep
    for owner in (results[last_stage + dp * tp][0] for dp in range(ep)):
        assert (owner.log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-4
        assert (owner.entropy[mask] - ref_entropy[mask]).abs().max() <= 1e-4
    exported, saved = stored(model_dir, results[0][1]), saved_checkpoint(model_dir)
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


# TP=2 x EP=2 recomputing every layer in its backward (the recipes' setting), and PP=2 (a windowed and a full layer
# a stage): each against one rank of the same model, which is held to transformers.
@pytest.mark.parametrize("tp,pp,ep,layers,extra", [
    (2, 1, 2, 2, {"actor.recompute_granularity": "full", "actor.recompute_method": "uniform",
                  "actor.recompute_num_layers": 1}),
    (1, 2, 1, 4, {})])
def test_one_update_matches_transformers_and_equals_one_rank(tmp_path, tp, pp, ep, layers, extra):
    model_dir = family_model_dir(tmp_path, "gpt_oss", tied=False, layers=layers)
    batch = make_batch(18)
    lr = {"actor.optim.lr": 1e-5, "actor.expert_tensor_parallel_size": 1}
    one = config(model_dir, 1, 1, **lr, **{"trainer.n_gpus_per_node": 1})
    ref_metrics, ref_state = run_distributed(update_and_export, 1, args=(one, batch))[0]
    log_probs, _, _ = hf_reference(model_dir, batch, one.rollout.temperature)
    hf_loss, hf_grad_norm = hf_update_reference(hf_model(model_dir), batch.__class__(
        **{**batch.__dict__, "old_log_probs": log_probs}), one)
    assert ref_metrics["actor/grad_norm"] == pytest.approx(hf_grad_norm, rel=1e-4)
    cfg = config(model_dir, tp, pp, **lr, **{"actor.expert_model_parallel_size": ep,
                                            "trainer.n_gpus_per_node": tp * pp * ep, **extra})
    results = run_distributed(update_and_export, tp * pp * ep, tp, pp, ep=ep, etp=1, args=(cfg, batch))
    # The last stage's first rank reports the (all-reduced) loss, rank 0 the weights.
    metrics, state = results[(pp - 1) * tp * ep][0], results[0][1]
    assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-6
    # (The clamp's wide weights give a gradient norm of about 10: fp32 sums in another order differ by ~1e-6 of it.)
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-5)
    assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-5
    initial = saved_checkpoint(model_dir)
    after = stored(model_dir, state)
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj"):
        assert not torch.equal(initial[name], after[name]), f"the update left {name} unchanged"


# One engine per rank, and one engine over both ranks (its experts and sinks split over the engine's TP ranks, the
# experts' output bias held by the first); the trainer at TP2 x EP2 or EP2.
@pytest.mark.parametrize("tp,ep,engine_tp", [(1, 2, 1), (2, 2, 2)])
def test_engines_hold_the_trainer_weights_and_generate_as_transformers(tmp_path, tp, ep, engine_tp):
    check_engines_hold_the_trainer_weights(family_model_dir(tmp_path, "gpt_oss", tied=False), tp, 1, 1, ep, engine_tp,
                                           "process_group", etp=1)


def test_an_mxfp4_folder_loads_at_ep2_as_transformers_dequantizes_it(tmp_path):
    """gpt-oss as released (its experts in MXFP4): `convert from-hf` at EP=2, each rank reading and dequantizing only
    its own experts, then `to-hf` at TP=2 writes the plain folder of transformers' dequantized model, bit for bit."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    folder, _, _ = write_released(str(tmp_path / "released"))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert convert(["from-hf", "--hf", folder, "--out", ckpt, "--ep", "2"]) == 0
    assert convert(["to-hf", "--ckpt", ckpt, "--out", out, "--tp", "2"]) == 0
    dequantized = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                    dtype=torch.bfloat16).state_dict()
    exported = saved_checkpoint(out)
    assert set(exported) == set(dequantized) and "quantization_config" not in read_hf_config(out)
    for name, tensor in dequantized.items():
        assert torch.equal(exported[name], tensor), name


def test_the_doctors_model_checks_pass_on_a_tiny_gpt_oss():
    """`python -m rl_megatron.doctor` with a gpt-oss model.path: the router, parity (the export compared as gpt-oss
    folders store it) and update checks pass."""
    results = {r.name: r for r in run_distributed(run_checks, 1, args=("gpt_oss", False))[0]}
    for name in ("stack: MoE router", "Megatron vs transformers (gpt_oss)", "update"):
        assert results[name].status == PASS, results[name]
    assert "37 of 37 weights exported bitwise" in results["Megatron vs transformers (gpt_oss)"].figure
