"""The step's levers (bench train --ladder), each held to the path without it on CPU, where it changes only rounding.

actor.optim.fused: torch's fused AdamW kernel where Megatron falls back to torch's optimizer (no TE, no Apex, as
here): one update equals foreach's within float32 rounding, and a checkpoint saved by a run of one kernel loads
into a run of the other with the other's (the param groups a checkpoint restores carry the saver's flag).
actor.fused_swiglu: Megatron's SwiGLU fusion (compiled by torch.compile, here inductor's C++ kernel): the same
log-probs and update as the unfused activation.
actor.fused_log_probs: the log-probs' and entropy's chunked work compiled (rl_megatron/models/logprobs.py), forward
and backward: the same log-probs and update at TP=2 as unfused (the function itself: tests/distributed/test_logprobs.py).
actor.gradient_accumulation_fusion: each weight gradient accumulated by its GEMM into the fp32 main grad
(rl_megatron/platform/wgrad_accumulation.py, as no Apex imports here), over four micro-batches at TP=2 with sequence
parallelism: the same update as DDP's add of each micro-batch's gradient."""
import dataclasses

import pytest

from helpers.parity import config, family_model_dir, largest_update_difference, make_batch
from helpers.ranks import actor_log_probs_everywhere, build_actor, saved_checkpoint
from helpers.worlds import run_distributed
from rl_megatron.workers.megatron_model import torch_optimizers


def kernels(actor) -> set:
    return {(group["fused"], group["foreach"]) for inner in torch_optimizers(actor.optimizer)
            for group in inner.param_groups}


def updates(cfg, batch) -> tuple:
    """The actor of `cfg`, its kernels, and two updates on `batch`: the weights after the first, both's metrics."""
    actor = build_actor(cfg)
    batch = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
    first = actor.update(batch)
    state = actor.hf_state_dict()
    return actor, kernels(actor), state, [first, actor.update(batch)]


def update_save_and_reload(fused_cfg, plain_cfg, batch, ckpt_dir):
    """Each kernel's updates; a plain actor loading the fused one's checkpoint. Returns what each holds."""
    fused, *fused_run = updates(fused_cfg, batch)
    fused.save_checkpoint(ckpt_dir)
    plain_run = updates(plain_cfg, batch)[1:]
    reloaded = build_actor(plain_cfg)
    reloaded.load_checkpoint(ckpt_dir)
    return fused_run, plain_run, kernels(reloaded)


def test_the_fused_kernel_updates_as_foreach_does_and_a_checkpoint_takes_the_loaders_kernel(tmp_path):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    fused, plain = (config(model_dir, 1, 1, **{"actor.optim.fused": on, "actor.optim.lr": 1e-3}) for on in (True, False))
    assert plain.actor.optim.fused is False and config(model_dir, 1, 1).actor.optim.fused is None  # null: CUDA's
    (fused_run, plain_run, reloaded_kernels) = run_distributed(update_save_and_reload, 1, args=(
        fused, plain, make_batch(), str(tmp_path / "ckpt")))[0]
    (fused_kernels, fused_state, fused_metrics), (plain_kernels, plain_state, plain_metrics) = fused_run, plain_run
    assert fused_kernels == {(True, False)} and plain_kernels == reloaded_kernels == {(None, None)}
    # An Adam step of lr 1e-3 (up to 1e-3 on every weight): the kernels a float32 rounding apart. The second step's
    # gradients then differ in their last bits, which Adam scales up where a gradient is near zero: compared by norm.
    initial = saved_checkpoint(model_dir)
    assert min((plain_state[name] - tensor).abs().max().item() for name, tensor in initial.items()) > 1e-4
    assert max((fused_state[name] - tensor).abs().max().item() for name, tensor in plain_state.items()) < 1e-6
    for mine, theirs in zip(fused_metrics, plain_metrics):
        assert mine["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-5)


def log_probs_and_update(cfg, batch):
    actor = build_actor(cfg)
    batch = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
    fused = {layer.mlp.config.bias_activation_fusion for chunk in actor.chunks for layer in chunk.decoder.layers}
    return fused, batch.old_log_probs, actor.update(batch), actor.hf_state_dict()


def fused_log_probs_and_update(cfg, batch):
    actor = build_actor(cfg)
    batch = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
    return actor.fused_log_probs, batch.old_log_probs, actor.update(batch), actor.hf_state_dict()


def test_the_fused_log_probs_give_the_unfused_ones_and_update_alike_at_tp2(tmp_path):
    """actor.fused_log_probs: the chunked log-probs and entropy compiled, forward and backward, in the actor's passes
    (its response positions only, vocabulary-parallel at TP=2): the same log-probs and update as unfused."""
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    runs = [run_distributed(fused_log_probs_and_update, 2, 2, 1, args=(config(model_dir, 2, 1, **{
        "actor.fused_log_probs": on, "actor.optim.lr": 1e-3}), make_batch()))[0] for on in (True, False)]
    (fused_flag, fused_log_probs, fused_metrics, fused_state), (plain_flag, log_probs, metrics, state) = runs
    assert fused_flag is True and plain_flag is False
    assert (fused_log_probs - log_probs).abs().max() <= 1e-6
    assert fused_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert largest_update_difference(fused_state, state) < 2e-5


def test_the_fused_swiglu_computes_what_the_unfused_one_does(tmp_path):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    runs = [run_distributed(log_probs_and_update, 1, args=(config(model_dir, 1, 1, **{
        "actor.fused_swiglu": on, "actor.optim.lr": 1e-3}), make_batch()))[0] for on in (True, False)]
    (fused_flags, fused_log_probs, fused_metrics, fused_state), (plain_flags, log_probs, metrics, state) = runs
    assert fused_flags == {True} and plain_flags == {False}
    assert (fused_log_probs - log_probs).abs().max() <= 1e-6
    assert fused_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    # Adam's first step, lr g / (|g| + eps), turns last-bit differences of gradients near eps into up to ~1e-5 of
    # the lr's 1e-3 (tests/distributed/test_router_replay.py meets the same): the updates agree to that.
    assert largest_update_difference(fused_state, state) < 2e-5


def wgrad_fusion_and_update(cfg, batch):
    actor = build_actor(cfg)
    batch = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
    fused = {chunk.config.gradient_accumulation_fusion for chunk in actor.chunks}
    return fused, actor.update(batch), actor.update(batch), actor.hf_state_dict()


def test_the_gradient_accumulation_fusion_updates_as_ddps_add_does_at_tp2(tmp_path):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    assert config(model_dir, 2, 1).actor.gradient_accumulation_fusion is None  # null: on with CUDA
    runs = [run_distributed(wgrad_fusion_and_update, 2, 2, 1, args=(config(model_dir, 2, 1, **{
        "actor.gradient_accumulation_fusion": on, "actor.optim.lr": 1e-3}), make_batch()))[0] for on in (True, False)]
    (fused_flags, *fused_metrics, fused_state), (plain_flags, *metrics, state) = runs
    assert fused_flags == {True} and plain_flags == {False}
    for mine, theirs in zip(fused_metrics, metrics):
        assert mine["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-5)
    # The GEMM adds its product into the accumulator instead of beside it: float32 rounding, which Adam's steps
    # scale up where a gradient is near zero (as for the SwiGLU fusion above).
    assert largest_update_difference(fused_state, state) < 4e-5
