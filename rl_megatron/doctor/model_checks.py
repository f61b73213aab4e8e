"""The doctor's checks of Megatron on one device, in a rank of their own (`checks.megatron` starts it: no Ray, no
vLLM). A tiny model of the config's family, built here with random weights: its MoE router on this stack's layers,
its log-probs and exported weights against transformers', an update, the offload round trip at the device's
layout; then `python -m rl_megatron.bench train`. Each `*_result` turns what was measured into PASS or FAIL."""
from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile

import megatron.core.transformer.moe.moe_utils as moe_utils
import torch
from megatron.core.transformer.moe.router import TopKRouter

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.bench.__main__ import parse_args, prepare, run_bench
from rl_megatron.config import Config
from rl_megatron.doctor.offload_check import (device_layout, offload_problems, round_trip, round_trip_batches,
                                              update_problems)
from rl_megatron.doctor.parity import (LOG_PROB_TOLERANCE, SEQ, VOCAB, actor_config, family_model_dir, hf_reference,
                                       make_batch, saved_checkpoint, tensor_differences)
from rl_megatron.doctor.report import FAIL, PASS, SKIP, Result, guarded
from rl_megatron.models.gpt import uses_transformer_engine
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.workers.megatron_actor import MegatronActor

ROUTER, UPDATE, OFFLOAD, BENCH = "stack: MoE router", "update", "offload round trip", "bench train"
MIB = 1 << 20
# `bench train` at its defaults on GPU (Qwen2.5-0.5B's shape); on CPU a model small enough for about a second, on one
# thread as the other checks here (CPU cores shared with other work slow a thread team down many times over).
CPU_BENCH_ARGS = ("--batch", "2", "--seq", "64", "--hidden", "128", "--layers", "2", "--vocab", "512", "--repeats", "1",
                  "--threads", "1")
PINNED_STACK = ("install the versions requirements-gpu.txt pins (pip install -r requirements-gpu.txt), and report "
                "this output if it persists")


def parity_name(model_type: str) -> str:
    return f"Megatron vs transformers ({model_type})"


def run_checks(model_type: str, tied: bool) -> list[Result]:
    """Every check on this rank (a world of one, after `init_distributed`: `platform.setup()` has run)."""
    with tempfile.TemporaryDirectory(prefix="rl_megatron-doctor-") as folder:
        model_dir = family_model_dir(folder, model_type, tied)
        cfg = actor_config(model_dir, tp=1, pp=1)
        batch = make_batch()
        actor = MegatronActor(cfg, read_hf_config(model_dir), optimizer_steps=10)
        results = guarded(ROUTER, lambda: router_check(actor, model_type))
        results += guarded(parity_name(model_type), lambda: parity_check(actor, model_type, batch, cfg))
        results += guarded(UPDATE, lambda: update_check(actor, batch))  # after the parity check: it changes weights
        results += guarded(OFFLOAD, lambda: offload_check(cfg))
    return results + guarded(BENCH, bench_train)


def router_check(actor: MegatronActor, model_type: str) -> Result:
    """One forward of the model's first router (Megatron's TopKRouter, as its MoE layers call it) on random tokens."""
    router = next((m for chunk in actor.chunks for m in chunk.modules() if isinstance(m, TopKRouter)), None)
    if router is None:
        return Result(ROUTER, SKIP, f"{model_type} is dense: no router")
    config = router.config
    tokens = torch.randn(SEQ, 2, config.hidden_size, device=platform.device(), dtype=config.params_dtype)
    try:
        with torch.no_grad():
            probs, routing_map = router(tokens)
    except Exception as err:  # the check's finding, reported with the fix
        return router_result(model_type, config.moe_router_topk, [], False, f"{type(err).__name__}: {err}")
    return router_result(model_type, config.moe_router_topk, routing_map.sum(-1).tolist(),
                         bool(torch.isfinite(probs).all()))


def router_result(model_type: str, top_k: int, experts_per_token: list[int], finite: bool, error: str = "") -> Result:
    gemm = "Transformer Engine's GEMM" if getattr(moe_utils, "te_general_gemm", None) is not None else "torch's GEMM"
    if error:
        return Result(ROUTER, FAIL, error, "Megatron's router runs without Transformer Engine once "
                      "rl_megatron.platform.setup() has bound moe_utils.te_general_gemm to None "
                      "(platform/megatron_fixes.py); if it still fails, " + PINNED_STACK)
    figure = f"{model_type}'s router on {gemm}: {len(experts_per_token)} tokens"
    if not finite or any(count != top_k for count in experts_per_token):
        return Result(ROUTER, FAIL, f"{figure}, routed to {sorted(set(experts_per_token))} experts (top-{top_k}); "
                      f"scores finite: {finite}", PINNED_STACK)
    return Result(ROUTER, PASS, f"{figure}, each routed to its top-{top_k} experts")


def parity_check(actor: MegatronActor, model_type: str, batch: TrainBatch, cfg: Config) -> Result:
    ours = actor.log_probs(batch)
    log_probs, entropy, _ = hf_reference(cfg.model.path, batch, cfg.rollout.temperature)
    mask = batch.response_mask.bool()
    gap = max(float((ours.log_probs[mask] - log_probs[mask]).abs().max()),
              float((ours.entropy[mask] - entropy[mask]).abs().max()))
    saved = saved_checkpoint(cfg.model.path)
    layers = "transformer_engine" if uses_transformer_engine() else "local"
    return parity_result(model_type, gap, LOG_PROB_TOLERANCE[layers],
                         tensor_differences(actor.table.stored_tensors(actor.hf_state_dict()), saved), len(saved))


def parity_result(model_type: str, gap: float, tolerance: float, mismatched: list[str], weights: int) -> Result:
    figure = (f"a tiny {model_type} with random weights: log-probs and entropy within {gap:.1e} of transformers' "
              f"(at most {tolerance:.0e}), {weights - len(mismatched)} of {weights} weights exported bitwise")
    if mismatched:
        return Result(parity_name(model_type), FAIL, f"{figure}; first differing: {mismatched[0]}", PINNED_STACK)
    if not gap <= tolerance:
        return Result(parity_name(model_type), FAIL, figure, PINNED_STACK)
    return Result(parity_name(model_type), PASS, figure)


def update_check(actor: MegatronActor, batch: TrainBatch) -> Result:
    """One optimizer step on the batch's (signed) advantages, on-policy: it must move each sample's log-probs
    with its advantage."""
    before = actor.log_probs(batch).log_probs
    weights = actor.hf_state_dict()
    metrics = actor.update(dataclasses.replace(batch, old_log_probs=before))
    after = actor.log_probs(batch).log_probs
    mask = batch.response_mask
    gain = float((batch.advantages[:, None] * (after - before) * mask).sum() / mask.sum())
    return update_result(metrics["actor/grad_norm"], gain, len(tensor_differences(actor.hf_state_dict(), weights)),
                         len(weights))


def update_result(grad_norm: float, gain: float, changed: int, weights: int) -> Result:
    figure = (f"one step: grad norm {grad_norm:.3g}, {changed} of {weights} weights changed, log-probs moved with "
              f"the advantages by {gain:+.1e} per token")
    if math.isfinite(grad_norm) and grad_norm > 0 and changed > 0 and gain > 0:
        return Result(UPDATE, PASS, figure)
    return Result(UPDATE, FAIL, figure, PINNED_STACK)


def offload_check(cfg: Config) -> Result:
    layout = device_layout()
    per_rank = [round_trip(cfg, round_trip_batches(VOCAB), layouts=(layout,))]
    measured = per_rank[0][layout]
    return offload_result(layout, sum(measured["moved"].values()), sum(measured["dropped"].values()),
                          offload_problems(per_rank, layout) + update_problems(per_rank, layout))


def offload_result(layout: str, moved: int, dropped: int, problems: list[str]) -> Result:
    if problems:
        return Result(OFFLOAD, FAIL, f"{layout}: " + "; ".join(problems), "actor.offload=false (the trainer's state "
                      "then stays on the GPUs), and report this output")
    return Result(OFFLOAD, PASS, f"{layout}: {moved / MIB:.1f} MiB to the host and back bitwise, {dropped / MIB:.1f} "
                  "MiB of gradients dropped and re-zeroed; the next update equals one without the round trip")


def bench_train() -> Result:
    args = parse_args(["train", *(() if platform.has_cuda() else CPU_BENCH_ARGS)])
    model_dir = prepare(args)
    try:
        return bench_result(run_bench(args, model_dir))
    finally:
        shutil.rmtree(model_dir)


def bench_result(figures: dict) -> Result:
    """`bench train`'s figures (a crash is the FAIL)."""
    mfu = f"MFU {figures['mfu']:.2f}" if figures["mfu"] is not None else f"no nominal peak for {figures['device']}"
    return Result(BENCH, PASS, f"{figures['params'] / 1e6:.1f}M parameters, {figures['dtype']}, "
                  f"{figures['layers_impl']} layers, {figures['batch']} x {figures['seq']} tokens: "
                  f"{figures['tokens_per_s']:.4g} tokens/s, {figures['ratio']:.2f} of a plain matmul's FLOP/s, {mfu}")
