"""Parameter counts and per-device memory, from a Hugging Face config.json and a parallel layout.

Counts come from the model family's Megatron <-> HF weight table (`models/family.py`): every Megatron parameter
the model has, its HF shapes and how tensor parallelism splits it, so the count is the one the trainer's shards
really have.

Memory per device (bytes), what the plan prints; the CUDA context, NCCL's buffers and fragmentation are NOT
included, so keep a margin:

  training state  = P_dense * (w + g + o / S_dense) + P_expert * (w + g + o / S_expert)
      P_dense, P_expert: one rank's parameters on its fullest pipeline stage (its layers: layers / PP, or with
          uneven stages the first / last stage's counts and even shares between, models/pipeline_stages.py; plus
          the embedding on the first stage and the output layer on the last), split over TP; routed experts over EP
          and each expert over expert-TP (ETP, default TP) instead
      w: weight bytes (2 for bfloat16, 4 for float32 model.dtype)
      g: gradient bytes, 4 (Megatron accumulates and reduces gradients in fp32: grad_reduce_in_fp32)
      o: optimizer bytes, 12 for bfloat16 (fp32 master copy + Adam m + v), 8 for float32 (m + v; the
          weights are their own master copy)
      S: 1 without the distributed optimizer (CPU); on GPU the distributed optimizer shards o over the
          data-parallel ranks with the context-parallel ones (Megatron's dp-cp group): S_dense = DP * CP,
          S_expert = DP * CP * TP / (ETP * EP) (the expert data-parallel size)
  frozen weights  = P * w (a reference model: forward only)
  LoRA actor      = P * w + P_lora * (w + g + o) + P_merged * w: the frozen base, the adapters trained (P_lora:
                    A [r, in] and B [out, r] per adapted projection, split over TP as their layer splits), and the
                    adapted layers' weights with the adapters merged, what the weight sync sends (P_merged: those
                    layers' weights on the rank); no reference model (the actor with its adapters off)
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
  A, one decoder layer's saved activations per token (two kinds in an MoE model with dense layers, e.g. DeepSeek's
  first_k_dense_replace):
      4h / t_sp                     the two norms' inputs and outputs (the outputs are QKV's and fc1's inputs)
    + (3 h_q + 3 h_kv) / TP         the fused QKV output (V is a view of it, so it stays whole), RoPE's Q and K,
                                    the attention output (the output projection's input)
    + h_q / TP                      per-head Q/K norms (Qwen3): the query's norm input
      or, multi-head latent attention instead (DeepSeek-V2/V3, Moonlight; Megatron's MLASelfAttention), with q_l,
      kv_l the query's and key/value's compression ranks (q_l = 0: queries straight from the hidden state) and per
      head n, r, v the key's non-rotary and rotary widths and the value's:
        (2 q_l + 2 kv_l) / t_sp     the compressed query and key/value and their norms' outputs (the up-projections'
                                    inputs), each token's on its own sequence-parallel rank
      + r                           the rotary key shared by all heads, gathered over the sequence
      + heads (3 (n + r) + n + 3 v) / TP   the query projection's output and the query after RoPE, the key/value
                                    up-projection's output, the assembled key, the value (made contiguous for the
                                    kernel) and the attention output. An approximation: RoPE's and the concatenations'
                                    temporaries that the backward does not keep are taken as kept; fused RoPE would
                                    save some
    + 5f / TP                       dense MLP: fc1's output 2f, silu's output f, the linear half + glu_linear_offset
                                    f, their product f (fc2's input): Megatron's unfused SwiGLU
      or k (2h * ETP + 5 f_e) / TP  MoE MLP instead (k experts per token of width f_e): each routed copy's input and
                                    output (gathered over ETP) and its SwiGLU, routing assumed balanced;
                                    + 5 f_s / TP, the shared experts' SwiGLU (width f_s, all of them together);
                                    + 8 E / t_sp bytes, the router's fp32 logits and probabilities over E experts
    + C                             the attention core beyond Q, K, V and its output: on GPU nothing (Transformer
                                    Engine's fused attention); on CPU K, V repeated to every query head, 2 h_q / TP
                                    when kv_heads < heads, and with packing (torch's flash attention per sample,
                                    models/packed_attention.py) the samples' outputs before they are joined, h_q /
                                    TP; without packing (Megatron's local attention) the softmax output over rows of
                                    S = min(T_mb, L) tokens instead, heads/TP * S * (4 + w if bfloat16) bytes (fp32
                                    softmax, cast back); with attention sinks (gpt-oss) on GPU without TE the per-span
                                    path's, and its softmax over S keys and the sink, heads/TP * (S + 1) * w bytes
                                    (counted by the pre-flight check, preflight/sink_attention.py, not by the plan)
  K_s, what pipeline stage s keeps per token of a micro-batch, summed over its layers (L_s of them: layers / PP,
      or the uneven split's; L_c = L_s / VPP per chunk): A each without recompute; A - C with selective recompute
      (the attention core); with full recompute a layer input h / t_sp per group of n = recompute_num_layers
      layers, ceil(L_c / n) of them per chunk (method uniform), or h / t_sp for the first n layers of each chunk
      and A for the others (method block)
  R_s, made again in one backward step: full uniform the A of n layers, full block one A, selective C, none 0
  head (last stage), per token: final norm and output-layer inputs 2h / t_sp, plus the policy's logits
      [T, V_pad / TP] in (w + 4c) bytes: the output layer's own output and c fp32 copies at the peak
      (models/logprobs.py, workers/megatron_actor.py): c = 3 in a forward pass (the temperature-scaled logits,
      entropy's exp and exp * logits), 2 in an update (the scaled logits, which the cross-entropy turns into its
      softmax in place; its gradient and the masked, scaled gradient), 5 with actor.entropy_coeff > 0 (the scaled
      logits and exp kept for the entropy's backward, the copy given to the cross-entropy, the two gradients of
      exp * logits); the critic's value head instead: h / t_sp + h (it gathers the sequence)
  update pass = T * max(m_s * K_s + R_s         each stage s but the last (PP > 1),
                        K_l + max(R_l, head))    the last; the head's copies are freed before the layers' backward
      m_s, micro-batches in flight on stage s: PP - s (1F1B); interleaved, Megatron's warm-up plus one, in chunks
      of 1 / VPP micro-batch: (2 (PP - s - 1) + (VPP - 1) PP + 1) / VPP (PP * (1 + (PP - 1) / (PP * VPP)) on the
      first). Even stages make the first the fullest; an uneven split can make another one so
  forward pass = T * max(A, head with c = 3) (no graph: one layer at a time; the critic's: T * A)
  role = actor: max(update, forward: the old log-probs); critic: max(update, values); reference: forward
  pool = its roles' weights and training states, the engine's share and the largest role's activations (the passes
         run one at a time), summed; but with actor.offload (GPU, engine colocated) they take turns and the pool needs
         its largest phase (`phase_memory.py`): training = the training states + activations + the sleeping engine's
         CUDA graphs (an allowance), generation = the engine's share, weight sync = the actor's and the engine's
         weights + resharding.bucket_mb + the graphs (each with the reference's weights if ref.param_offload=false)
  Not counted (a few percent): the flash kernels' log-sum-exp (heads fp32 per token), token ids and masks, the
  pipeline's send and receive buffers, the MoE dispatcher's index tensors, and under context parallelism each
  sample's padding to a multiple of 2 * CP (* TP with sequence parallelism) tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from rl_megatron.launch.model_shape import ModelShape
from rl_megatron.models.family import moe_experts, table_for
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers
from rl_megatron.models.weight_tables import padded_vocab_size

GIB = 1024 ** 3
WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}
GRAD_BYTES = 4  # fp32 main gradients (grad_reduce_in_fp32=True in workers/megatron_model.py)
OPTIMIZER_BYTES = {"bfloat16": 12, "float32": 8}  # fp32 master copy (bf16 only) + Adam's two moments
FP32 = 4
# fp32 copies of the [tokens, vocabulary / TP] logits alive at the peak of each pass (the module docstring says which).
# An upper bound now: the actor's passes compute the logits of the response tokens only, without sequence parallelism,
# and models/logprobs.py holds about 3/16 of them in fp32 at a time; the plan keeps the whole-logits figures.
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
                    value_head: bool = False, etp: int | None = None, vpp: int = 1,
                    stages: StageLayers = StageLayers(), transformer_engine: bool = False) -> RankParameters:
    """One rank's parameter count on its fullest pipeline stage. `value_head`: the critic, whose output layer
    is a scalar head (hidden -> 1) instead of the vocabulary projection; `etp`: the experts' TP size (default
    `tp`); `vpp` and `stages`: which layers each stage holds (interleaved chunks; uneven first / last stages);
    `transformer_engine`: its layers' shards (MLA's down projections whole on every TP rank). tp=pp=ep=1 gives
    the whole model."""
    table = table_for(hf, padded_vocab_size(hf["vocab_size"], vocab_divisible_by, tp), transformer_engine)
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
    split = PipelineSplit(hf["num_hidden_layers"], pp, vpp, stages)
    per_stage = []
    for stage in range(pp):
        counts = [layer_parameters(layer) for layer in split.stage_layers(stage)]
        extra = (embedding if stage == 0 else 0) + (final_norm + output if stage == pp - 1 else 0)
        per_stage.append(RankParameters(dense=sum(d for d, _ in counts) + extra, expert=sum(e for _, e in counts)))
    return max(per_stage, key=lambda params: params.total)


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


def gib_text(n: int) -> str:
    """Bytes as the plan prints them: GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


# How a role's attention runs: "fused" (Transformer Engine, GPU), "spans" (CPU, packed rows: torch's flash attention
# per sample), "local" (CPU, right-padded rows: Megatron's DotProductAttention, which keeps the scores) or "sinks"
# (attention sinks without TE: packed_attention.attention_with_sinks per span, which keeps its softmax output).
Attention = Literal["fused", "spans", "local", "sinks"]


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
    stages: StageLayers = StageLayers()  # uneven first / last pipeline stages
    sequence_parallel: bool = False
    attention: Attention = "fused"
    trains: bool = True
    recompute: Optional[Literal["full", "selective"]] = None  # None: no recomputation
    recompute_method: Optional[Literal["uniform", "block"]] = None  # full (Megatron requires one; unset: uniform)
    recompute_num_layers: Optional[int] = None  # full: layers per group (uniform) or per chunk (block); unset: 1
    policy_head: bool = True  # vocabulary logits (actor, reference) or a scalar value head (critic)
    entropy_bonus: bool = False  # actor.entropy_coeff > 0: the update keeps more copies of the logits
    routing: bool = False  # the passes carry each token's experts (routing replay, moe/routing_agreement)


@dataclass(frozen=True)
class Activations:
    """A role's activation estimate (bytes per GPU on its fullest stage) and what it is made of."""

    bytes: int  # the larger pass's
    tokens: int  # T, a micro-batch's tokens on one rank
    update: int  # the training pass (0 for a frozen role)
    forward: int  # the pass without a graph: log-probs (actor, reference) or values (critic)
    logits: int  # the policy head's logits (and copies) in the larger pass; 0 for the value head
    routing: int = 0  # of `bytes`, the experts each token is routed through (or compared with): see routing_bytes

    @property
    def larger_pass(self) -> str:
        return "update" if self.update >= self.forward else "forward"


def layer_bytes(shape: ModelShape, run: RolePasses, routed: Optional[bool] = None) -> tuple[float, float]:
    """(A, C) per token of one rank: a decoder layer's saved activations, and the part of them that is the
    attention core's (0 with Transformer Engine's fused attention); see the module docstring. `routed`: whether
    the layer's MLP is the MoE one (default: whether the model has experts)."""
    w, tp = WEIGHT_BYTES[run.dtype], run.tp
    t_sp = tp if run.sequence_parallel else 1
    h, d = shape.hidden, shape.head_dim
    elements = 4 * h / t_sp + _attention_elements(shape, tp, t_sp)
    if shape.experts if routed is None else routed:
        etp = run.etp or tp
        elements += (shape.top_k * (2 * h * etp + 5 * shape.expert_ffn) + 5 * shape.shared_ffn) / tp
        router = FP32 * 2 * shape.experts / t_sp
    else:
        elements += 5 * shape.ffn / tp
        router = 0
    core = 0.0
    if run.attention != "fused":
        # Latent attention's heads each have a key and value of their own: nothing is repeated.
        h_q = shape.heads * (shape.latent.v_head_dim if shape.latent else d)
        repeated = w * 2 * h_q / tp if shape.kv_heads < shape.heads else 0  # K, V repeated to the query heads
        if run.attention in ("spans", "sinks"):
            core = repeated + w * h_q / tp  # each sample's output, kept by its kernel, beside the joined output
            if run.attention == "sinks":  # the softmax over each query's keys and its head's sink
                core += shape.heads / tp * (run.row_tokens + 1) * w
        else:
            softmax = FP32 + (w if w < FP32 else 0)  # the fp32 softmax output, and its cast back to a 16-bit dtype
            core = repeated + shape.heads / tp * run.row_tokens * softmax
    return w * elements + router + core, core


def _attention_elements(shape: ModelShape, tp: int, t_sp: int) -> float:
    """The attention's saved elements per token of one rank beyond its norm (module docstring): GQA's or MLA's."""
    latent = shape.latent
    if latent is None:
        h_q, h_kv = shape.heads * shape.head_dim, max(shape.kv_heads, tp) * shape.head_dim  # kv heads: >= 1 per rank
        return (3 * h_q + 3 * h_kv) / tp + (h_q / tp if shape.qk_norm else 0)
    n, r, v = latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.v_head_dim
    compressed = (2 * latent.q_lora_rank + 2 * latent.kv_lora_rank) / t_sp + r
    return compressed + shape.heads * (3 * (n + r) + n + 3 * v) / tp


def _kept_and_recomputed(run: RolePasses, chunks: list[list[float]], checkpoint: float,
                         cores: list[float]) -> tuple[float, float]:
    """Per token of one micro-batch: what one pipeline stage keeps for the backward, and what the backward of one
    recompute unit makes again. `chunks`: the A of each layer of each of the stage's model chunks; `cores`: the C
    of its layers; `checkpoint`: a layer input's bytes."""
    layers = [a for chunk in chunks for a in chunk]
    if run.recompute is None:
        return sum(layers), 0.0
    if run.recompute == "selective":
        return sum(layers) - sum(cores), max(cores)
    n, kept, recomputed = run.recompute_num_layers or 1, 0.0, 0.0
    for chunk in chunks:
        if run.recompute_method == "block":  # the first n layers each recomputed alone, the others keep everything
            kept += min(n, len(chunk)) * checkpoint + sum(chunk[n:])
            recomputed = max(recomputed, max(chunk[:n], default=0.0))
        else:  # uniform: groups of n layers, each keeping its input
            groups = [chunk[i:i + n] for i in range(0, len(chunk), n)]
            kept += len(groups) * checkpoint
            recomputed = max(recomputed, max((sum(group) for group in groups), default=0.0))
    return kept, recomputed


def head_bytes(shape: ModelShape, run: RolePasses, logit_copies: int, vocab_multiple: int) -> tuple[float, float]:
    """(head, logits) per token on the last stage: the final norm's and output layer's inputs plus the logits with
    `logit_copies` fp32 copies (the policy), or the value head's inputs (the critic)."""
    w, t_sp = WEIGHT_BYTES[run.dtype], run.tp if run.sequence_parallel else 1
    if not run.policy_head:
        return w * (shape.hidden / t_sp + shape.hidden), 0.0
    vocab = padded_vocab_size(shape.vocab, vocab_multiple, run.tp) / run.tp
    logits = vocab * (w + FP32 * logit_copies)
    return w * 2 * shape.hidden / t_sp + logits, logits


def in_flight(pp: int, vpp: int, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at once: PP - stage with 1F1B; interleaved,
    Megatron's warm-up micro-batches plus one, each a chunk of 1 / VPP of the stage (module docstring)."""
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(pp - stage)
    return (2 * (pp - stage - 1) + (vpp - 1) * pp + 1) / vpp


def activation_bytes(shape: ModelShape, run: RolePasses, vocab_multiple: int = 1) -> Activations:
    """A role's activations per GPU (module docstring); `vocab_multiple`: model.make_vocab_size_divisible_by."""
    tokens = -(-run.tokens // run.cp)
    kinds = {routed: layer_bytes(shape, run, routed) for routed in {shape.routes(i) for i in range(shape.layers)}}
    forward_head, forward_logits = head_bytes(shape, run, LOGIT_COPIES_FORWARD, vocab_multiple)
    if not run.policy_head:
        forward_head = 0.0  # the values need no working set beyond a layer's
    forward = int(tokens * max(max(layer for layer, _ in kinds.values()), forward_head))
    update, update_logits = 0, 0.0
    if run.trains:
        copies = LOGIT_COPIES_UPDATE_ENTROPY if run.entropy_bonus else LOGIT_COPIES_UPDATE
        head, update_logits = head_bytes(shape, run, copies, vocab_multiple)
        checkpoint = WEIGHT_BYTES[run.dtype] * shape.hidden / (run.tp if run.sequence_parallel else 1)
        split, stages = PipelineSplit(shape.layers, run.pp, run.vpp, run.stages), []
        for stage in range(run.pp):
            chunks = [[kinds[shape.routes(i)][0] for i in chunk] for chunk in split.chunks(stage)]
            cores = [kinds[shape.routes(i)][1] for i in split.stage_layers(stage)]
            kept, recomputed = _kept_and_recomputed(run, chunks, checkpoint, cores)
            last = stage == run.pp - 1
            stages.append(kept + max(recomputed, head) if last
                          else in_flight(run.pp, run.vpp, stage) * kept + recomputed)
        update = int(tokens * max(stages))
    logits = update_logits if update >= forward else forward_logits
    routing = routing_bytes(shape, run, tokens)
    forward, update = forward + routing, update + routing * run.trains
    return Activations(bytes=max(update, forward), tokens=tokens, update=update, forward=forward,
                       logits=int(tokens * logits), routing=routing)


def routing_bytes(shape: ModelShape, run: RolePasses, tokens: int) -> int:
    """A micro-batch's routing on one rank (`models/router_replay.py`): each token's experts in every MoE layer, as
    the int64 ids Megatron's replay gathers with (the share of the sequence-parallel rank), held through the pass.
    (The step's routing waits in host memory as int16: 2 bytes per token, layer and slot.)"""
    if not run.routing:
        return 0
    moe_layers = sum(shape.routes(i) for i in range(shape.layers))
    return -(-tokens // (run.tp if run.sequence_parallel else 1)) * moe_layers * shape.top_k * 8
