"""Parameter counts and per-device memory, from a Hugging Face config.json and a parallel layout.

Counts come from the model family's Megatron <-> HF weight table (`models/family.py`): every Megatron parameter
the model has, its HF shapes and how tensor parallelism splits it, so the count is the one the trainer's shards
really have.

Memory per device (bytes), what the plan prints; the CUDA context, NCCL's buffers and fragmentation are NOT
included, so keep a margin:

  training state  = P_dense * (w + g + o / S_dense) + P_expert * (w + g + o / S_expert)
      P_dense, P_expert: one rank's parameters on its fullest pipeline stage (layers / PP, plus the embedding on
          the first stage and the output layer on the last), split over TP; routed experts over EP and each expert
          over expert-TP (ETP, default TP) instead
      w: weight bytes (2 for bfloat16, 4 for float32 model.dtype)
      g: gradient bytes, 4 (Megatron accumulates and reduces gradients in fp32: grad_reduce_in_fp32)
      o: optimizer bytes, 12 for bfloat16 (fp32 master copy + Adam m + v), 8 for float32 (m + v; the
          weights are their own master copy)
      S: 1 without the distributed optimizer (CPU); on GPU the distributed optimizer shards o over the
          data-parallel ranks with the context-parallel ones (Megatron's dp-cp group): S_dense = DP * CP,
          S_expert = DP * CP * TP / (ETP * EP) (the expert data-parallel size)
  frozen weights  = P * w (a reference model: forward only)
  rollout engine  = on GPU rollout.gpu_memory_utilization * GPU memory (vLLM takes that fraction for its
                    weights, P_total * w / rollout TP, plus the KV cache); on CPU the weights + rollout.kv_cache_bytes
  activations     = Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (per
                    layer s*b*h*(34 + 5*a*s/h) bytes in 16 bit; / TP with sequence parallelism; 5as/h gone with flash
                    attention or selective recompute; 2sbh with full recompute), adapted to these models (RMSNorm,
                    GQA, SwiGLU, MoE, no dropout) and to RL's log-prob head, per role, below.

Activations of one role (bytes on its fullest pipeline stage), in w-byte elements unless said otherwise:
  L    = data.max_prompt_length + rollout.max_tokens, the longest sample
  T_mb = max(<role>.max_tokens_per_micro_batch, L) (a sample longer than the budget runs alone), else
         <role>.micro_batch_size * L: the tokens one micro-batch computes on a data-parallel rank (right-padded
         micro-batches under a budget compute their padding too, which is not counted: pack them)
  T    = ceil(T_mb / CP): the tokens of a micro-batch on one rank (context parallelism splits every sequence)
  t_sp = TP with sequence parallelism (actor.sequence_parallel, None: on at TP > 1), else 1
  h, f = hidden and FFN (intermediate) size; h_q = heads * head_dim, h_kv = kv_heads * head_dim (at least one
         kv head per TP rank: Megatron replicates them when TP exceeds them)
  A, one decoder layer's saved activations per token:
      4h / t_sp                     the two norms' inputs and outputs (the outputs are QKV's and fc1's inputs)
    + (3 h_q + 3 h_kv) / TP         the fused QKV output (V is a view of it, so it stays whole), RoPE's Q and K,
                                    the attention output (the output projection's input)
    + h_q / TP                      per-head Q/K norms (Qwen3): the query's norm input
    + 5f / TP                       dense MLP: fc1's output 2f, silu's output f, the linear half + glu_linear_offset
                                    f, their product f (fc2's input): Megatron's unfused SwiGLU
      or k (2h * ETP + 5 f_e) / TP  MoE MLP instead (k experts per token of width f_e): each routed copy's input and
                                    output (gathered over ETP) and its SwiGLU, routing assumed balanced;
                                    + 8 E / t_sp bytes, the router's fp32 logits and probabilities over E experts
    + C                             the attention core beyond Q, K, V and its output: on GPU nothing (Transformer
                                    Engine's fused attention); on CPU K, V repeated to every query head, 2 h_q / TP
                                    when kv_heads < heads, and with packing (torch's flash attention per sample,
                                    models/packed_attention.py) the samples' outputs before they are joined, h_q /
                                    TP; without packing (Megatron's local attention) the softmax output over rows of
                                    S = min(T_mb, L) tokens instead, heads/TP * S * (4 + w if bfloat16) bytes (fp32
                                    softmax, cast back)
  K, what one pipeline stage keeps per token of a micro-batch (L_s = layers / PP, L_c = L_s / VPP per chunk):
      L_s * A without recompute; L_s * (A - C) with selective recompute (the attention core); with full recompute
      a layer input h / t_sp per group of n = recompute_num_layers layers, VPP * ceil(L_c / n) of them (method
      uniform), or h / t_sp for the first n layers of each chunk and A for the others (method block)
  R, made again in one backward step: full uniform n * A, full block A, selective C, none 0
  head (last stage), per token: final norm and output-layer inputs 2h / t_sp, plus the policy's logits
      [T, V_pad / TP] in (w + 4c) bytes: the output layer's own output and c fp32 copies at the peak
      (models/logprobs.py, workers/megatron_actor.py): c = 3 in a forward pass (the temperature-scaled logits,
      entropy's exp and exp * logits), 2 in an update (the scaled logits, which the cross-entropy turns into its
      softmax in place; its gradient and the masked, scaled gradient), 5 with actor.entropy_coeff > 0 (the scaled
      logits and exp kept for the entropy's backward, the copy given to the cross-entropy, the two gradients of
      exp * logits); the critic's value head instead: h / t_sp + h (it gathers the sequence)
  update pass = T * max(m * K + R           the first stage (PP > 1),
                        K + max(R, head))    the last; the head's copies are freed before the layers' backward
      m, micro-batches in flight on the first stage: PP (1F1B), PP * (1 + (PP - 1) / (PP * VPP)) interleaved
  forward pass = T * max(A, head with c = 3) (no graph: one layer at a time; the critic's: T * A)
  role = actor: max(update, forward: the old log-probs); critic: max(update, values); reference: forward
  pool = its roles' weights and training states + the engine's share + the largest role's activations (the passes
         run one at a time)
  Not counted (a few percent): the flash kernels' log-sum-exp (heads fp32 per token), token ids and masks, the
  pipeline's send and receive buffers, the MoE dispatcher's index tensors, and under context parallelism each
  sample's padding to a multiple of 2 * CP (* TP with sequence parallelism) tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from rl_megatron.models.family import family_of, moe_experts, table_for
from rl_megatron.models.weight_tables import padded_vocab_size

GIB = 1024 ** 3
WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}
GRAD_BYTES = 4  # fp32 main gradients (grad_reduce_in_fp32=True in workers/megatron_actor.py)
OPTIMIZER_BYTES = {"bfloat16": 12, "float32": 8}  # fp32 master copy (bf16 only) + Adam's two moments
FP32 = 4
# fp32 copies of the [tokens, vocabulary / TP] logits alive at the peak of each pass (the module docstring says which)
LOGIT_COPIES_FORWARD = 3
LOGIT_COPIES_UPDATE = 2
LOGIT_COPIES_UPDATE_ENTROPY = 5


@dataclass(frozen=True)
class RankParameters:
    """Parameters one rank holds on its fullest pipeline stage: those every expert-parallel rank has, and its
    share of the routed experts (their optimizer state shards over a smaller data-parallel group)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_parameters(hf: dict, tp: int = 1, pp: int = 1, ep: int = 1, vocab_divisible_by: int = 1,
                    value_head: bool = False, etp: int | None = None) -> RankParameters:
    """One rank's parameter count on its fullest pipeline stage. `value_head`: the critic, whose output layer
    is a scalar head (hidden -> 1) instead of the vocabulary projection; `etp`: the experts' TP size (default
    `tp`). tp=pp=ep=1 gives the whole model."""
    table = table_for(hf, padded_vocab_size(hf["vocab_size"], vocab_divisible_by, tp))
    experts_per_rank = moe_experts(hf) // ep

    def layer_parameters(layer: int) -> tuple[int, int]:
        dense = expert = 0
        for name, entry in table.layer_entries(layer).items():
            if name.startswith("mlp.experts."):  # one entry stands for every routed expert of the layer
                expert += math.prod(entry.local_shape(etp or tp)) * experts_per_rank
            else:
                dense += math.prod(entry.local_shape(tp))
        return dense, expert

    embedding = math.prod(table.other["embedding.word_embeddings.weight"].local_shape(tp))
    final_norm = math.prod(table.other["decoder.final_layernorm.weight"].local_shape(tp))
    if value_head:
        output = hf["hidden_size"]
    elif table.tied and pp == 1:  # one stage holds both ends: Megatron shares the embedding as output layer
        output = 0
    else:  # untied, or tied across stages: the last stage keeps its own copy
        output = math.prod(table.other["output_layer.weight"].local_shape(tp))
    per_stage = hf["num_hidden_layers"] // pp
    stages = []
    for stage in range(pp):
        counts = [layer_parameters(layer) for layer in range(stage * per_stage, (stage + 1) * per_stage)]
        extra = (embedding if stage == 0 else 0) + (final_norm + output if stage == pp - 1 else 0)
        stages.append(RankParameters(dense=sum(d for d, _ in counts) + extra, expert=sum(e for _, e in counts)))
    return max(stages, key=lambda params: params.total)


def training_state_bytes(params: RankParameters, dtype: str, dp: int, ep: int, cp: int,
                         distributed_optimizer: bool, tp: int = 1, etp: int | None = None) -> int:
    """Weights + fp32 gradients + Adam state of one rank (see the module docstring for the formula)."""
    dense_shards = dp * cp if distributed_optimizer else 1
    expert_shards = max(dp * cp * tp // ((etp or tp) * ep), 1) if distributed_optimizer else 1
    per_param = WEIGHT_BYTES[dtype] + GRAD_BYTES
    optimizer = OPTIMIZER_BYTES[dtype]
    return int(params.dense * (per_param + optimizer / dense_shards)
               + params.expert * (per_param + optimizer / expert_shards))


def weight_bytes(parameters: int, dtype: str) -> int:
    return parameters * WEIGHT_BYTES[dtype]


# How a role's attention runs: "fused" (Transformer Engine, GPU), "spans" (CPU, packed rows: torch's flash attention
# per sample) or "local" (CPU, right-padded rows: Megatron's DotProductAttention, which keeps the scores).
Attention = Literal["fused", "spans", "local"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes activations are made of, from a config.json (with the moe section's overrides)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0

    @classmethod
    def of(cls, hf: dict) -> ModelShape:
        family, heads = family_of(hf), hf["num_attention_heads"]
        experts = family.experts(hf)
        return cls(hidden=hf["hidden_size"], ffn=hf.get("intermediate_size", 0), heads=heads,
                   kv_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, layers=hf["num_hidden_layers"],
                   vocab=hf["vocab_size"], qk_norm=family.qk_layernorm, experts=experts,
                   top_k=hf["num_experts_per_tok"] if experts else 0,
                   expert_ffn=hf[family.moe.width_key] if experts else 0)


@dataclass(frozen=True)
class RolePasses:
    """How one role's Megatron passes hold activations: its layout and its config keys (already resolved)."""

    tokens: int  # T_mb: tokens of one micro-batch on one data-parallel rank, before CP
    row_tokens: int  # S: the longest row Megatron's local attention scores (attention "local" only)
    dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    etp: Optional[int] = None  # None: TP
    sequence_parallel: bool = False
    attention: Attention = "fused"
    trains: bool = True
    recompute: Optional[Literal["full", "selective"]] = None  # None: no recomputation
    recompute_method: Optional[Literal["uniform", "block"]] = None  # full (Megatron requires one; unset: uniform)
    recompute_num_layers: Optional[int] = None  # full: layers per group (uniform) or per chunk (block); unset: 1
    policy_head: bool = True  # vocabulary logits (actor, reference) or a scalar value head (critic)
    entropy_bonus: bool = False  # actor.entropy_coeff > 0: the update keeps more copies of the logits


@dataclass(frozen=True)
class Activations:
    """A role's activation estimate (bytes per GPU on its fullest stage) and what it is made of."""

    bytes: int  # the larger pass's
    tokens: int  # T, a micro-batch's tokens on one rank
    update: int  # the training pass (0 for a frozen role)
    forward: int  # the pass without a graph: log-probs (actor, reference) or values (critic)
    logits: int  # the policy head's logits (and copies) in the larger pass; 0 for the value head

    @property
    def larger_pass(self) -> str:
        return "update" if self.update >= self.forward else "forward"


def layer_bytes(shape: ModelShape, run: RolePasses) -> tuple[float, float]:
    """(A, C) per token of one rank: a decoder layer's saved activations, and the part of them that is the
    attention core's (0 with Transformer Engine's fused attention); see the module docstring."""
    w, tp = WEIGHT_BYTES[run.dtype], run.tp
    t_sp = tp if run.sequence_parallel else 1
    h, d = shape.hidden, shape.head_dim
    h_q, h_kv = shape.heads * d, max(shape.kv_heads, tp) * d  # kv heads replicated up to one per TP rank
    elements = 4 * h / t_sp + (3 * h_q + 3 * h_kv) / tp + (h_q / tp if shape.qk_norm else 0)
    if shape.experts:
        etp = run.etp or tp
        elements += shape.top_k * (2 * h * etp + 5 * shape.expert_ffn) / tp
        router = FP32 * 2 * shape.experts / t_sp
    else:
        elements += 5 * shape.ffn / tp
        router = 0
    core = 0.0
    if run.attention != "fused":
        repeated = w * 2 * h_q / tp if shape.kv_heads < shape.heads else 0  # K, V repeated to the query heads
        if run.attention == "spans":
            core = repeated + w * h_q / tp  # each sample's output, kept by its kernel, beside the joined output
        else:
            softmax = FP32 + (w if w < FP32 else 0)  # the fp32 softmax output, and its cast back to a 16-bit dtype
            core = repeated + shape.heads / tp * run.row_tokens * softmax
    return w * elements + router + core, core


def _kept_and_recomputed(shape: ModelShape, run: RolePasses, layer: float, core: float) -> tuple[float, float]:
    """Per token of one micro-batch: what one pipeline stage keeps for the backward, and what the backward of one
    recompute unit makes again."""
    stage_layers = shape.layers // run.pp
    if run.recompute is None:
        return stage_layers * layer, 0.0
    if run.recompute == "selective":
        return stage_layers * (layer - core), core
    checkpoint = WEIGHT_BYTES[run.dtype] * shape.hidden / (run.tp if run.sequence_parallel else 1)
    chunk_layers, n = stage_layers // run.vpp, run.recompute_num_layers or 1
    if run.recompute_method == "block":
        recomputed = min(n, chunk_layers)
        per_chunk = recomputed * checkpoint + (chunk_layers - recomputed) * layer
        return run.vpp * per_chunk, layer if recomputed else 0.0
    groups = -(-chunk_layers // n)
    return run.vpp * groups * checkpoint, min(n, chunk_layers) * layer


def head_bytes(shape: ModelShape, run: RolePasses, logit_copies: int, vocab_multiple: int) -> tuple[float, float]:
    """(head, logits) per token on the last stage: the final norm's and output layer's inputs plus the logits with
    `logit_copies` fp32 copies (the policy), or the value head's inputs (the critic)."""
    w, t_sp = WEIGHT_BYTES[run.dtype], run.tp if run.sequence_parallel else 1
    if not run.policy_head:
        return w * (shape.hidden / t_sp + shape.hidden), 0.0
    vocab = padded_vocab_size(shape.vocab, vocab_multiple, run.tp) / run.tp
    logits = vocab * (w + FP32 * logit_copies)
    return w * 2 * shape.hidden / t_sp + logits, logits


def in_flight(pp: int, vpp: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: PP with 1F1B, more interleaved."""
    if pp == 1:
        return 1.0
    return pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(pp)


def activation_bytes(shape: ModelShape, run: RolePasses, vocab_multiple: int = 1) -> Activations:
    """A role's activations per GPU (module docstring); `vocab_multiple`: model.make_vocab_size_divisible_by."""
    tokens = -(-run.tokens // run.cp)
    layer, core = layer_bytes(shape, run)
    forward_head, forward_logits = head_bytes(shape, run, LOGIT_COPIES_FORWARD, vocab_multiple)
    if not run.policy_head:
        forward_head = 0.0  # the values need no working set beyond a layer's
    forward = int(tokens * max(layer, forward_head))
    update, update_logits = 0, 0.0
    if run.trains:
        copies = LOGIT_COPIES_UPDATE_ENTROPY if run.entropy_bonus else LOGIT_COPIES_UPDATE
        head, update_logits = head_bytes(shape, run, copies, vocab_multiple)
        kept, recomputed = _kept_and_recomputed(shape, run, layer, core)
        last = kept + max(recomputed, head)
        first = in_flight(run.pp, run.vpp) * kept + recomputed if run.pp > 1 else last
        update = int(tokens * max(first, last))
    logits = update_logits if update >= forward else forward_logits
    return Activations(bytes=max(update, forward), tokens=tokens, update=update, forward=forward,
                       logits=int(tokens * logits))
