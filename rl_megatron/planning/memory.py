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
  A, one decoder layer's saved activations per token (`layer_memory.py` has its formula, by part and by where the
      layers run: norms, RoPE's tables, attention or MLA and its core C, the dense or MoE MLP; two kinds in an MoE
      model with dense layers, e.g. DeepSeek's first_k_dense_replace)
  K_s, what pipeline stage s keeps per token of a micro-batch, summed over its layers (L_s of them: layers / PP,
      or the uneven split's; L_c = L_s / VPP per chunk): A each without recompute; with selective recompute the
      attention core's inputs instead of C; with full recompute a layer input h / t_sp per group of
      n = recompute_num_layers layers, ceil(L_c / n) of them per chunk (method uniform), or h / t_sp for the first n
      layers of each chunk and A for the others (method block)
  R_s, made again in one backward step: full uniform the A of n layers, full block one A, selective C, none 0
  head (last stage), per token: the final norm and the output layer's input, N h / t_sp (`layer_memory.py`'s
      norm: 2h / t_sp with TE), plus the policy's logits
      [T, V_pad / TP] in (w + 4c) bytes: the output layer's own output and c fp32 copies at the peak
      (models/logprobs.py, workers/megatron_actor.py): c = 3 in a forward pass (the temperature-scaled logits,
      entropy's exp and exp * logits), 2 in an update (the scaled logits, which the cross-entropy turns into its
      softmax in place; its gradient and the masked, scaled gradient), 5 with actor.entropy_coeff > 0 (the scaled
      logits and exp kept for the entropy's backward, the copy given to the cross-entropy, the two gradients of
      exp * logits); the critic's value head instead: the final norm's, its output gathered over the sequence h
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
  pipeline's send and receive buffers, and under context parallelism each sample's padding to a multiple of 2 * CP
  (* TP with sequence parallelism) tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# RolePasses, Attention and layer_bytes are this module's API too (the plan, the pre-flight checks and tests import
# them from here).
from rl_megatron.planning.layer_memory import (FP32, WEIGHT_BYTES, Attention, LayerBytes, RolePasses,  # noqa: F401
                                               layer_bytes, norm_bytes)
from rl_megatron.planning.model_shape import ModelShape
from rl_megatron.models.family import moe_experts, table_for
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers
from rl_megatron.models.weight_tables import padded_vocab_size

GIB = 1024 ** 3
GRAD_BYTES = 4  # fp32 main gradients (grad_reduce_in_fp32=True in workers/megatron_model.py)
OPTIMIZER_BYTES = {"bfloat16": 12, "float32": 8}  # fp32 master copy (bf16 only) + Adam's two moments
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


def _kept_and_recomputed(run: RolePasses, chunks: list[list[LayerBytes]], checkpoint: float) -> tuple[float, float]:
    """Per token of one micro-batch: what one pipeline stage keeps for the backward, and what the backward of one
    recompute unit makes again. `chunks`: the `LayerBytes` of each layer of each of the stage's model chunks;
    `checkpoint`: a layer input's bytes."""
    layers = [layer for chunk in chunks for layer in chunk]
    if run.recompute is None:
        return sum(layer.kept for layer in layers), 0.0
    if run.recompute == "selective":
        return sum(layer.selective for layer in layers), max(layer.core for layer in layers)
    n, kept, recomputed = run.recompute_num_layers or 1, 0.0, 0.0
    for chunk in chunks:
        whole = [layer.kept for layer in chunk]
        if run.recompute_method == "block":  # the first n layers each recomputed alone, the others keep everything
            kept += min(n, len(whole)) * checkpoint + sum(whole[n:])
            recomputed = max(recomputed, max(whole[:n], default=0.0))
        else:  # uniform: groups of n layers, each keeping its input
            groups = [whole[i:i + n] for i in range(0, len(whole), n)]
            kept += len(groups) * checkpoint
            recomputed = max(recomputed, max((sum(group) for group in groups), default=0.0))
    return kept, recomputed


def head_bytes(shape: ModelShape, run: RolePasses, logit_copies: int, vocab_multiple: int) -> tuple[float, float]:
    """(head, logits) per token on the last stage: the final norm's (its output the output layer's input) plus the
    logits with `logit_copies` fp32 copies (the policy), or the final norm's with its output gathered over the
    sequence for the value head (the critic)."""
    w, t_sp = WEIGHT_BYTES[run.dtype], run.tp if run.sequence_parallel else 1
    norm = norm_bytes(run, shape.hidden / t_sp)
    if not run.policy_head:
        return norm - w * shape.hidden / t_sp + w * shape.hidden, 0.0
    vocab = padded_vocab_size(shape.vocab, vocab_multiple, run.tp) / run.tp
    logits = vocab * (w + FP32 * logit_copies)
    return norm + logits, logits


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
    kind = {i: (shape.routes(i), i in shape.windowed) for i in range(shape.layers)}  # MoE or dense, windowed or not
    kinds = {key: layer_bytes(shape, run, *key) for key in set(kind.values())}
    forward_head, forward_logits = head_bytes(shape, run, LOGIT_COPIES_FORWARD, vocab_multiple)
    if not run.policy_head:
        forward_head = 0.0  # the values need no working set beyond a layer's
    forward = int(tokens * max(max(layer.kept for layer in kinds.values()), forward_head))
    update, update_logits = 0, 0.0
    if run.trains:
        copies = LOGIT_COPIES_UPDATE_ENTROPY if run.entropy_bonus else LOGIT_COPIES_UPDATE
        head, update_logits = head_bytes(shape, run, copies, vocab_multiple)
        checkpoint = WEIGHT_BYTES[run.dtype] * shape.hidden / (run.tp if run.sequence_parallel else 1)
        split, stages = PipelineSplit(shape.layers, run.pp, run.vpp, run.stages), []
        for stage in range(run.pp):
            chunks = [[kinds[kind[i]] for i in chunk] for chunk in split.chunks(stage)]
            kept, recomputed = _kept_and_recomputed(run, chunks, checkpoint)
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
