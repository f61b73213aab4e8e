"""Context parallelism (two CUDA GPUs with Transformer Engine): the packed sequences split over 2 CP ranks give the
log-probs, entropy and update (loss, gradient norm, new weights) of CP=1, on the same weights. Needs what CP needs:
TE's attention, so two GPUs and transformer-engine; skipped elsewhere (CPU workers refuse
actor.context_parallel_size > 1 at build time). Nothing on this path imports vLLM or Ray.

    pytest tests/gpu/test_context_parallel_gpu.py -m gpu -v
"""
import importlib.util

import pytest
import torch

from helpers.parity import config, family_model_dir, long_tailed_batch
from rl_megatron.workers.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs"),
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="context parallelism needs transformer-engine")]


def log_probs_and_update(cfg, batch):
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)
    out = actor.log_probs(batch)
    batch.old_log_probs = None if out is None else out.log_probs
    shared = [batch.old_log_probs]
    torch.distributed.broadcast_object_list(shared, src=0)
    batch.old_log_probs = shared[0]
    return out, actor.update(batch), actor.hf_state_dict()


def test_context_parallel_matches_one_rank(tmp_path):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    batch = long_tailed_batch()
    common = {"actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 8, "rollout.n": 2,
              "data.train_batch_size": 8, "actor.optim.lr": 1e-4}
    ref_out, ref_metrics, ref_state = run_distributed(
        log_probs_and_update, 1, args=(config(model_dir, 1, 1, **common, **{"trainer.n_gpus_per_node": 1}), batch))[0]
    cfg = config(model_dir, 1, 1, **common, **{"trainer.n_gpus_per_node": 2, "actor.context_parallel_size": 2})
    out, metrics, state = run_distributed(log_probs_and_update, 2, args=(cfg, batch), cp=2)[0]
    mask = batch.response_mask.bool()
    assert (out.log_probs[mask] - ref_out.log_probs[mask]).abs().max() <= 2e-3  # TE may run fp32 GEMMs in TF32
    assert (out.entropy[mask] - ref_out.entropy[mask]).abs().max() <= 2e-3
    assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=2e-3)
    # A gradient CP times too large shows here only: Adam's step (scale-free) hides it in the new weights.
    assert abs(metrics["actor/grad_norm"] - ref_metrics["actor/grad_norm"]) <= 5e-3 * ref_metrics["actor/grad_norm"]
    assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-4
