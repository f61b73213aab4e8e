"""Attention sinks (gpt-oss) on a CUDA run without Transformer Engine: the scores that no fused kernel spares.

With TE, its fused attention takes the sinks. Without it, `models/packed_attention.attention_with_sinks` forms each
span's scores per head explicitly: for a micro-batch of T tokens in spans of at most S, one layer holds up to four
[T, S + 1] tensors per head on a TP rank (`FORWARD_COPIES`, `BACKWARD_COPIES`), and a pass that trains keeps the
probabilities of every layer it does not recompute. The memory plan counts TE's fused attention on GPU, none of
this; so this check adds it (the role's activations with the sinks' attention, `memory.py`'s "sinks", less the
plan's, plus the copies alive beside one layer's probabilities at its peak) and refuses a role whose scores do not
fit what the plan leaves of the GPU in the phase where the role computes.

Whether TE builds the layers is decided on the driver: CUDA there, and a findable `transformer_engine` package (the
workers import it, `models.gpt.uses_transformer_engine`; an install that does not import is the doctor's FAIL).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from rl_megatron.config.pools import worker_pools
from rl_megatron.config.schema import Config
from rl_megatron.errors import ConfigError
from rl_megatron.models.family import family_of
from rl_megatron.models.hf_config import role_model_config
from rl_megatron.planning.memory import GIB, WEIGHT_BYTES, RolePasses, activation_bytes, gib_text
from rl_megatron.planning.model_shape import ModelShape
from rl_megatron.planning.phase_memory import compute_phase
from rl_megatron.planning.plan import ClusterPlan, build_plan, role_passes
from rl_megatron.roles import Role

# Score-sized tensors one layer holds at its peak, as measured on an H200 (torch 2.11, bf16 and fp32: 3.0-3.1 and
# 4.1-4.2 of them, 1.06-1.10 kept after the forward). Forward: the masked scores, those joined with the sink column,
# the probabilities. Backward: the kept probabilities, the gradient reaching them, that gradient padded for the sink
# column, the softmax's gradient.
FORWARD_COPIES, BACKWARD_COPIES = 3, 4
TE_INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.9,<3'"


def score_bytes(heads: int, tp: int, tokens: int, span: int, dtype: str) -> int:
    """One score-sized tensor on a TP rank: heads / TP x `tokens` x (`span` + 1) (each query against the keys of its
    span, at most `span`, and its head's sink) in the model's dtype."""
    return heads // tp * tokens * (span + 1) * WEIGHT_BYTES[dtype]


def layer_score_bytes(heads: int, tp: int, tokens: int, span: int, dtype: str, trains: bool) -> int:
    """One layer's scores at their peak on a TP rank: in its backward for a pass that trains, else at its softmax."""
    return (BACKWARD_COPIES if trains else FORWARD_COPIES) * score_bytes(heads, tp, tokens, span, dtype)


def sink_attention_bytes(shape: ModelShape, passes: RolePasses, vocab_multiple: int = 1) -> int:
    """What a role's passes (`passes`, as the plan has them: fused attention) hold beyond the plan when the sinks'
    scores are formed explicitly: its activations with the sinks' attention less the plan's, plus the copies beside
    the probabilities (which the activations count) at one layer's peak."""
    sinks = activation_bytes(shape, dataclasses.replace(passes, attention="sinks"), vocab_multiple).bytes
    fused = activation_bytes(shape, passes, vocab_multiple).bytes
    sizes = (shape.heads, passes.tp, passes.tokens, passes.row_tokens, passes.dtype)
    return sinks - fused + layer_score_bytes(*sizes, passes.trains) - score_bytes(*sizes)


def at_length(passes: RolePasses, longest: int, budget: Optional[int], micro_batch_size: int) -> RolePasses:
    """`passes` with samples of at most `longest` tokens, micro-batches formed as `plan.role_passes` forms them."""
    tokens = max(budget, longest) if budget else micro_batch_size * longest
    return dataclasses.replace(passes, tokens=tokens, row_tokens=min(tokens, longest))


def longest_fitting(fits: Callable[[int], bool], longest: int) -> int:
    """The longest sample length below `longest` that `fits` (every length shorter than one that fits, fits); 0 if
    none does."""
    low, high = 0, longest - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def check_sink_attention(cfg: Config, hf: dict, cuda: bool, transformer_engine: bool) -> None:
    """Each Megatron role of a family with attention sinks, on a CUDA run without Transformer Engine: its scores
    against what the memory plan leaves (module docstring); ConfigError naming the keys and the fixes."""
    if not cuda or transformer_engine:
        return
    pools = worker_pools(cfg)
    models = {name: role_model_config(cfg, name, hf) for pool in pools for name in pool.roles if name.has_model}
    if not any(family_of(role_hf).sinks for role_hf in models.values()):
        return
    plan = build_plan(cfg, on_gpu=True, refuse_over_memory=False)  # its own refusal comes when the run starts
    gpu = int(plan.gpu_memory_gib * GIB)
    for spec, pool in zip(pools, plan.pools):
        phase = compute_phase(pool.phases)
        for role in pool.roles:
            role_hf = models.get(role.name, hf)
            if role.activations is None or not family_of(role_hf).sinks:
                continue
            # What the plan holds there with this role's activations as the pool's largest.
            others = phase.bytes - pool.activation_bytes + role.activation_bytes
            passes = role_passes(role.name, cfg, spec.layout, True, role_hf)
            shape, multiple = ModelShape.of(role_hf), cfg.model.make_vocab_size_divisible_by
            needed = sink_attention_bytes(shape, passes, multiple)
            if others + needed > gpu:
                raise ConfigError(_refusal(cfg, role.name, pool.name, role_hf["model_type"], passes, shape, needed,
                                           gpu - others, plan))


def _refusal(cfg: Config, name: Role, pool: Role, model_type: str, passes: RolePasses, shape: ModelShape,
             needed: int, room: int, plan: ClusterPlan) -> str:
    """The message for role `name` (in `pool`'s processes) whose sink scores (`needed` bytes) exceed `room`."""
    section = getattr(cfg, str(name))
    budget, batch = section.max_tokens_per_micro_batch, section.micro_batch_size
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    multiple = cfg.model.make_vocab_size_divisible_by
    fitting = longest_fitting(lambda length: sink_attention_bytes(
        shape, at_length(passes, length, budget, batch), multiple) <= room, longest)
    tokens = (f"{name}.max_tokens_per_micro_batch={budget}" if budget
              else f"{name}.micro_batch_size={batch} x {longest}")
    one_layer = layer_score_bytes(shape.heads, passes.tp, passes.tokens, passes.row_tokens, passes.dtype, passes.trains)
    fixes = [f"install Transformer Engine on the GPU nodes ({TE_INSTALL}: its fused attention takes the sinks)"]
    if fitting:
        fixes.append(f"lower data.max_prompt_length + rollout.max_tokens = {longest} to at most {fitting}")
    if passes.tp < shape.heads:
        fixes.append(f"raise {pool}.tensor_model_parallel_size={passes.tp} (each GPU forms the scores of heads / TP "
                     f"of the {shape.heads} heads)")
    if name.trainable and section.recompute_granularity is None:
        fixes.append(f"set {name}.recompute_granularity=selective (the attention recomputed in the backward: one "
                     "layer's probabilities kept at a time, not every layer's)")
    room_text = gib_text(room) if room > 0 else "nothing"
    return (f"{name}: model_type={model_type} has attention sinks, and without Transformer Engine "
            "(transformer_engine is not installed on this node) each layer forms its scores explicitly: "
            f"micro-batches of {passes.tokens} tokens ({tokens}) in samples of up to {passes.row_tokens} "
            f"(data.max_prompt_length + rollout.max_tokens) hold {gib_text(one_layer)} of scores per layer at its "
            f"peak: {gib_text(needed)} per GPU beyond what the memory plan counts (TE's fused attention), where the "
            f"plan leaves {room_text} of the GPU's {plan.gpu_memory_gib:g} GiB ({plan.gpu_memory_source}). Change: "
            + "; or ".join(fixes) + ".")
