"""Megatron shards on gloo against single-process references: HF transformers for log-probs and weights,
TP=1 x PP=1 for the GRPO update."""
import glob

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import config, family_model_dir, hf_reference, make_batch
from helpers.ranks import log_probs_and_export, update_and_export
from rl_megatron.models.tiny import LLAMA3_ROPE, QWEN2_5_YARN
from helpers.worlds import run_distributed


# Rope scaling with a short original context, so that most rotary dimensions are rescaled within 12 positions:
# Llama 3.1's, and YaRN (Qwen2.5's long-context setting) with its attention factor.


# Interleaving (vpp=2) needs a layer per model chunk: 2 stages x 2 chunks. Mistral's window of 4 positions is
# shorter than the sequences.
@pytest.mark.parametrize("family,tp,pp,vpp,tied,extra", [
    ("qwen2", 2, 1, 1, False, {}), ("qwen2", 1, 2, 1, False, QWEN2_5_YARN), ("llama", 2, 1, 1, True, LLAMA3_ROPE),
    ("qwen2", 1, 2, 2, False, {}), ("qwen3", 1, 2, 2, True, {}),
    ("mistral", 2, 1, 1, False, {"sliding_window": 4})])
def test_log_probs_and_export_match_transformers(tmp_path, family, tp, pp, vpp, tied, extra):
    model_dir = family_model_dir(tmp_path / family, family, tied, layers=2 * vpp, **extra)
    cfg = config(model_dir, tp, pp, vpp)
    batch = make_batch(18)
    results = run_distributed(log_probs_and_export, tp * pp, tp, pp, vpp, args=(cfg, batch))
    ref_log_probs, ref_entropy, ref_state = hf_reference(model_dir, batch, cfg.rollout.temperature)
    owner = results[-1][0] if pp > 1 else results[0][0]
    mask = batch.response_mask.bool()
    assert (owner.log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-4
    assert (owner.entropy[mask] - ref_entropy[mask]).abs().max() <= 1e-4
    exported = results[0][1]
    if tied:  # one tensor, exported once under the embedding's name
        ref_state.pop("lm_head.weight")
    assert set(exported) == set(ref_state)
    for name, tensor in ref_state.items():
        assert torch.equal(exported[name], tensor), name


# Tied embeddings at PP=2 x VPP=2: the embedding (first chunk, first stage) and the output layer (last chunk,
# last stage) must receive the same summed gradient.
# (TP=2 and plain PP=2 against one rank: tests/distributed/test_ppo_invariance.py.)
@pytest.mark.parametrize("tp,pp,vpp,tied", [(1, 2, 2, True)])
def test_grpo_update_equals_tp1_pp1(tmp_path, tp, pp, vpp, tied):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=tied, layers=2 * vpp)
    batch = make_batch(18)
    lr = {"actor.optim.lr": 1e-5}
    ref_metrics, ref_state = run_distributed(update_and_export, 1, args=(config(model_dir, 1, 1, **lr), batch))[0]
    cfg = config(model_dir, tp, pp, vpp, **lr)
    sharded = run_distributed(update_and_export, tp * pp, tp, pp, vpp, args=(cfg, batch))
    metrics, state = sharded[-1][0], sharded[0][1]  # the last pipeline stage reports the loss, rank 0 the weights
    assert abs(metrics["actor/pg_loss"] - ref_metrics["actor/pg_loss"]) <= 1e-6
    assert abs(metrics["actor/grad_norm"] - ref_metrics["actor/grad_norm"]) <= 1e-5
    changed = max((ref_state[n] - t).abs().max().item() for n, t in state.items())
    assert changed <= 1e-5
    initial = {}
    for f in glob.glob(f"{model_dir}/*.safetensors"):
        initial.update(load_file(f))
    assert any(not torch.equal(initial[n], t) for n, t in state.items()), "the update changed nothing"


def test_uneven_pipeline_stages_match_transformers(tmp_path):
    """3 layers at PP=2, the first stage holding 1 (actor.num_layers_in_first_pipeline_stage) and the last 2: each
    stage builds its layers with Megatron's offsets, the log-probs are transformers', every weight exports whole."""
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False, layers=3)
    cfg = config(model_dir, 1, 2, **{"actor.num_layers_in_first_pipeline_stage": 1})
    batch = make_batch(18)
    (_, exported), (last, _) = run_distributed(log_probs_and_export, 2, 1, 2, args=(cfg, batch))
    ref_log_probs, _, ref_state = hf_reference(model_dir, batch, cfg.rollout.temperature)
    mask = batch.response_mask.bool()
    assert (last.log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-4
    assert set(exported) == set(ref_state)
    assert all(torch.equal(exported[name], tensor) for name, tensor in ref_state.items())
