"""The step's performance metrics, verl's names: the actor's MFU (`perf/mfu/actor`: the update's forward and backward
passes; `perf/mfu/actor_infer`: the old log-probs' forward pass) and the workers' memory
(`perf/max_memory_allocated_gb` on GPU, `perf/cpu_memory_used_gb`).

Model FLOPs of one sequence of s tokens through a forward pass, in verl's convention (verl/utils/flops_counter.py),
so that the figures compare with a verl run's:

    2 * N * s + 2 * L * Hq * s^2

N: the weights each token multiplies: per layer the attention's projections (QKV and output; latent attention's
down and up projections) and the gated MLP (an MoE layer: the router, its shared experts and its top-k routed
experts, not all of them), counted from the family's weight table, plus 2 * vocab * hidden for the embedding and the
output layer. (The embedding is a lookup, not a multiply; verl counts it, and so do we.) The second term is
attention's QK^T and AV: 4 * Hq * s^2 per layer over the full square, halved for the causal mask; L layers, Hq =
heads x head_dim. A backward pass costs twice the forward, so training is 3x. Only the sequences' own tokens count
(prompt and response), never padding: MFU measures useful work.

    MFU = model FLOPs / (seconds x the sum of the actor's devices' peak FLOP/s)

with the step's timings of the phase (`old_log_prob`, `update_actor`: the whole call, dispatch and phase moves
included) and each device's peak as its worker reported it (`platform.device_stats.peak_flops`).
"""
from __future__ import annotations

import math

from rl_megatron.models.family import family_of, head_dim, table_for
from rl_megatron.platform.device_stats import DeviceStats

TRAINING_PASS_FORWARDS = 3  # the backward pass computes the inputs' gradients and the weights': two forwards' work


def matmul_weights_per_token(hf: dict) -> int:
    """N: the weights one token is multiplied by (config.json `hf`), the embedding counted as verl counts it: every
    matrix of the family's weight table (norms and biases aside), a routing layer's experts top-k times (a token
    goes through that many)."""
    table = table_for(hf, hf["vocab_size"])
    weights = 0
    for layer in range(table.num_layers):
        for name, entry in table.layer_entries(layer).items():
            if len(entry.hf_shapes[0]) < 2:
                continue
            size = sum(math.prod(shape) for shape in entry.hf_shapes)
            weights += size * hf["num_experts_per_tok"] if name.startswith("mlp.experts.") else size
    return weights + 2 * hf["vocab_size"] * hf["hidden_size"]


def attention_width(hf: dict) -> int:
    """Hq of the attention term: heads x head_dim; with latent attention the mean of the query/key width (nope +
    rope) and the value width, as QK^T and AV each take half of the term."""
    heads = hf["num_attention_heads"]
    if family_of(hf).mla:
        return heads * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"]) // 2
    return heads * head_dim(hf)


def forward_flops(hf: dict, sequence_lengths: list[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths (module docstring)."""
    tokens, squares = sum(sequence_lengths), sum(s * s for s in sequence_lengths)
    return 2 * matmul_weights_per_token(hf) * tokens + 2 * hf["num_hidden_layers"] * attention_width(hf) * squares


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
