"""The step's performance metrics, verl's names: the actor's MFU (`perf/mfu/actor`: the update's forward and backward
passes; `perf/mfu/actor_infer`: the old log-probs' forward pass) and the workers' memory
(`perf/max_memory_allocated_gb` on GPU, `perf/cpu_memory_used_gb`).

Model FLOPs of one sequence of s tokens through a forward pass, in verl's convention (verl/utils/flops_counter.py),
so that the figures compare with a verl run's:

    2 * N * s + 2 * L * Hq * s^2

N: the weights each token multiplies: per layer the QKV and attention-output projections and the gated MLP (an
MoE layer: the router and its top-k experts, not all of them), plus 2 * vocab * hidden for the embedding and the
output layer. (The embedding is a lookup, not a multiply; verl counts it, and so do we.) The second term is
attention's QK^T and AV: 4 * Hq * s^2 per layer over the full square, halved for the causal mask; L layers, Hq =
heads x head_dim. A backward pass costs twice the forward, so training is 3x. Only the sequences' own tokens count
(prompt and response), never padding: MFU measures useful work.

    MFU = model FLOPs / (seconds x the sum of the actor's devices' peak FLOP/s)

with the step's timings of the phase (`old_log_prob`, `update_actor`: the whole call, dispatch and phase moves
included) and each device's peak as its worker reported it (`platform.device_stats.peak_flops`).
"""
from __future__ import annotations

from rl_megatron.models.family import family_of
from rl_megatron.platform.device_stats import DeviceStats

TRAINING_PASS_FORWARDS = 3  # the backward pass computes the inputs' gradients and the weights': two forwards' work


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def matmul_weights_per_token(hf: dict) -> int:
    """N: the weights one token is multiplied by (config.json `hf`), the embedding counted as verl counts it."""
    hidden, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    q, kv = heads * _head_dim(hf), hf.get("num_key_value_heads", heads) * _head_dim(hf)
    attention = hidden * (q + 2 * kv) + q * hidden  # QKV, output projection
    family = family_of(hf)
    if family.moe is None:
        mlp = 3 * hidden * hf["intermediate_size"]  # gate, up, down
    else:
        router = hidden * family.experts(hf)
        mlp = router + hf["num_experts_per_tok"] * 3 * hidden * hf[family.moe.width_key]
    return layers * (attention + mlp) + 2 * hf["vocab_size"] * hidden


def forward_flops(hf: dict, sequence_lengths: list[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths (module docstring)."""
    attention_width = hf["num_attention_heads"] * _head_dim(hf)
    tokens, squares = sum(sequence_lengths), sum(s * s for s in sequence_lengths)
    return 2 * matmul_weights_per_token(hf) * tokens + 2 * hf["num_hidden_layers"] * attention_width * squares


def mfu(flops: float, seconds: float, peaks: list[float | None]) -> float | None:
    """Achieved FLOP/s over the devices' summed peak; None when a device has no known peak."""
    if not peaks or any(peak is None for peak in peaks):
        return None
    return flops / (seconds * sum(peaks))


def actor_mfu_metrics(hf: dict, sequence_lengths: list[int], seconds: dict[str, float], peaks: list[float | None],
                      ppo_epochs: int) -> dict[str, float]:
    """`perf/mfu/actor_infer` (the old log-probs) and `perf/mfu/actor` (the update: `ppo_epochs` training passes over
    the batch), for the phases the step ran (`seconds`: the step's timings) on the actor's devices (`peaks`, one per
    worker). A metric whose peak is unknown is left out."""
    forward = forward_flops(hf, sequence_lengths)
    work = {"perf/mfu/actor_infer": ("old_log_prob", forward),
            "perf/mfu/actor": ("update_actor", ppo_epochs * TRAINING_PASS_FORWARDS * forward)}
    metrics = {}
    for name, (phase, flops) in work.items():
        value = mfu(flops, seconds[phase], peaks) if phase in seconds else None
        if value is not None:
            metrics[name] = value
    return metrics


def memory_metrics(stats: list[DeviceStats]) -> dict[str, float]:
    """The most any worker reported: the GPU allocator's peak during the step (GPU only) and its node's host memory
    in use."""
    metrics = {"perf/cpu_memory_used_gb": max(s.cpu_memory_used_gb for s in stats)}
    allocated = [s.max_memory_allocated_gb for s in stats if s.max_memory_allocated_gb is not None]
    if allocated:
        metrics["perf/max_memory_allocated_gb"] = max(allocated)
    return metrics
