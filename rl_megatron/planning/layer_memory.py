"""One decoder layer's activations per token of a micro-batch on one rank (`memory.py`'s A): what autograd keeps of
it for the backward pass, what it keeps under selective recomputation, and what that backward makes again.
tests/distributed/test_memory_plan.py holds these figures to the bytes autograd saves in every family's tiny model.

In w-byte elements (w: 2 for bfloat16, 4 for float32) unless said; TP, ETP, t_sp (TP with sequence parallelism,
else 1) as in memory.py; h, f = hidden and FFN size; h_q = heads * head_dim, h_kv = kv_heads * head_dim (at least one
kv head per TP rank: Megatron replicates them). The layers are Transformer Engine's on GPU (attention "fused"), else
Megatron's local ones over torch's ops: on the CPU ("local": right-padded rows, "spans": packed ones; gpt-oss's
layers take the sinks' path there) and on a GPU without TE ("sinks": what the pre-flight check adds for gpt-oss,
preflight/sink_attention.py; torch's norms there are taken to keep what TE's do, unmeasured).

  norms      2 N h / t_sp, an RMSNorm's N per element: its input and output (the next layer's input), 2; torch's
             RMSNorm on the CPU keeps its input in fp32 (a copy in 16 bit, the 16-bit input then not kept), the
             normalized input in fp32 and the output, (8 + w) / w
  RoPE       unfused RoPE (without TE; MLA's everywhere): the cos and sin over the rotated dimensions r_d of the
             queries and of the keys, 4 r_d (whole on every TP rank), per position of a right-padded row (its
             micro-batch's rows share them: x S / T_mb) or per token of a packed one
  attention  the output projection's input O = h_q / TP, and the core's inputs QKV = (h_q + 2 h_kv) / TP (V is a view
             of the fused projection's output, which stays whole while anything keeps V) and RoPE's Q h_q / TP and
             K h_kv / TP, or those the core keeps instead, by implementation:
      fused    the inputs (TE's softmax statistics, heads fp32 per token, not counted)
      local    Megatron's DotProductAttention: RoPE's Q, and K and V repeated to every query head 2 h_q / TP (GQA) or
               the inputs; the softmax over S = min(T_mb, L) keys, heads / TP * S * (4 + w in 16 bit: fp32, cast back)
               bytes (and an [S, S] mask per row, not counted)
      spans    packed rows (and sliding windows in right-padded ones, which Megatron's local attention takes on
               CUDA only): torch's fused attention per span length, whose inputs are the spans' copies of Q, K, V
               (h_q + 2 h_kv) / TP, and its output h_q / TP (its log-sum-exp not counted); nothing of QKV. MLA's
               values are narrower than its keys, which takes torch's math path: Q, K, V in fp32 and the fp32
               softmax over a span's keys (S at most), heads / TP * S * 4 bytes, instead of the output
      sinks    attention sinks without TE (gpt-oss: the sinks' path whatever the rows, models/packed_attention.py): the
               query's copy h_q / TP, K and V repeated to every head 2 h_q / TP, the softmax over each span's S keys
               and the sink, heads / TP * (S + 1) * w bytes
             Selective recomputation keeps the inputs and O whatever the implementation (the checkpointed core's
             inputs and output); the backward makes the core's own tensors (the rest) again, one layer at a time.
             Per-head Q/K norms (Qwen3, GLM): their inputs, the query copied out of the grouped layout h_q / TP (GQA;
             a view of QKV without) and the key (a view of QKV, kept then); torch's on the CPU also the normalized Q
             and K in fp32, 4 (h_q + h_kv) / TP bytes, and in 16 bit fp32 copies of the inputs instead of them
    or multi-head latent attention (DeepSeek-V2/V3, Moonlight; Megatron's MLASelfAttention), with q_l, kv_l the
    query's and key/value's compression ranks (q_l = 0: queries straight from the hidden state) and per head n, r, v
    the key's non-rotary and rotary widths and the value's:
             (N q_l + N kv_l) / t_sp  the compressed query and key/value, with their norms (the up-projections' inputs)
           + r                        the rotary key shared by all heads, gathered over the sequence (part of the
                                      key/value norm's input; not kept where torch's norm copies it to fp32)
           + heads (2 (n + r) + 2 v) / TP  the inputs: the assembled query and key, the value made contiguous; and O
             (the up-projections' outputs are split and joined, never kept), through the same implementations
  MLP        dense: 5 f / TP, fc1's output 2f, silu's output f, the linear half + glu_linear_offset f, their product
             f (fc2's input): Megatron's unfused SwiGLU
             MoE: k (h ETP + g f_e) / TP, each routed copy's input (gathered over ETP) and its GLU, routing assumed
             balanced: g = 6, the SwiGLU's 5 and its product with the router's weight (fc2's input: Megatron weighs
             each copy in its expert, so the experts' outputs are not kept); 8 with gpt-oss's clamped SwiGLU (the
             clamped input, its sigmoid and the gated product kept as well)
           + 5 f_s / TP, the shared experts (width f_s, all of them together), + h / t_sp for Qwen2-MoE's gate (the
             shared output it scales)
           + (9 E + 24 k) / t_sp bytes of routing over E experts: the router's scores, the dispatcher's weights
             (fp32) and routing map (bool) per expert; the top-k and permutation ids (int64), the top-k and permuted
             weights (fp32) per copy (a router's extras, DeepSeek's group scores, not counted)
  Not counted: each norm's fp32 1/rms per row, the masks and log-sum-exps named above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

from rl_megatron.planning.model_shape import ModelShape
from rl_megatron.models.pipeline_stages import StageLayers

WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}
FP32 = 4

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

    @property
    def on_cpu(self) -> bool:
        """Megatron's local layers on the CPU: torch's RMSNorm as the CPU runs it, unfused RoPE."""
        return self.attention in ("local", "spans")


class LayerBytes(NamedTuple):
    """Bytes per token of one rank that a decoder layer keeps for the backward pass: without recomputation (A), with
    selective recomputation, and what the backward of a selectively recomputed layer makes again (its core's)."""

    kept: float
    selective: float
    core: float


def norm_bytes(run: RolePasses, width: float) -> float:
    """Bytes per token one RMSNorm over `width` elements keeps, its output included (module docstring)."""
    w = WEIGHT_BYTES[run.dtype]
    return width * (2 * FP32 + w if run.on_cpu else 2 * w)


def layer_bytes(shape: ModelShape, run: RolePasses, routed: Optional[bool] = None,
                windowed: Optional[bool] = None) -> LayerBytes:
    """A decoder layer's `LayerBytes` (module docstring). `routed`: whether its MLP is the MoE one (default: whether
    the model has experts); `windowed`: whether a sliding window limits its attention (default: any layer's)."""
    t_sp = run.tp if run.sequence_parallel else 1
    windowed = bool(shape.windowed) if windowed is None else windowed
    common = (2 * norm_bytes(run, shape.hidden / t_sp) + _rope_tables(shape, run)
              + _mlp_bytes(shape, run, bool(shape.experts) if routed is None else routed))
    kept, selective, core = _attention_bytes(shape, run, _core(shape, run, windowed))
    return LayerBytes(common + kept, common + selective, core)


def _core(shape: ModelShape, run: RolePasses, windowed: bool) -> Attention:
    """The attention implementation a layer runs: without TE, attention sinks take their own path, and a sliding
    window takes the packed one in right-padded rows too (`models/packed_attention.PackedDotProductAttention`)."""
    if run.on_cpu and shape.sinks:
        return "sinks"
    return "spans" if run.attention == "local" and windowed else run.attention


def _rope_tables(shape: ModelShape, run: RolePasses) -> float:
    if run.attention == "fused" and shape.latent is None:
        return 0.0  # TE's fused RoPE keeps no tables
    share = run.row_tokens / run.tokens if run.attention == "local" else 1.0  # right-padded rows share positions
    return WEIGHT_BYTES[run.dtype] * 4 * shape.rotated * share


def _attention_bytes(shape: ModelShape, run: RolePasses, core_kind: Attention) -> tuple[float, float, float]:
    """(kept, kept under selective recomputation, the core's own) bytes per token of the attention beyond its norm."""
    w, tp, latent = WEIGHT_BYTES[run.dtype], run.tp, shape.latent
    t_sp, heads = (tp if run.sequence_parallel else 1), shape.heads / tp
    if latent is None:  # V is a view of the fused QKV output: its bytes are QKV's
        h_q, h_kv = heads * shape.head_dim, max(shape.kv_heads, tp) * shape.head_dim / tp
        q, k, v, v_own, out, qkv = h_q, h_kv, h_kv, 0.0, h_q, h_q + 2 * h_kv
        grouped, compressed = max(shape.kv_heads, tp) < shape.heads, 0.0
    else:
        n, r = latent.qk_nope_head_dim, latent.qk_rope_head_dim
        q = k = heads * (n + r)
        v = v_own = out = heads * latent.v_head_dim
        qkv, grouped = 0.0, False
        # The rotary key rides in the key/value down-projection's output, which the norm keeps as its input (torch's
        # in 16 bit keeps an fp32 copy of the rest instead).
        compressed = (norm_bytes(run, (latent.q_lora_rank + latent.kv_lora_rank) / t_sp)
                      + (0 if run.on_cpu and w < FP32 else w * r))
    inputs = q + k + v_own  # beside QKV: the core's inputs, which selective recomputation keeps
    if core_kind == "fused":
        keeps_qkv, kept, core = True, inputs, 0.0
    elif core_kind == "local":
        softmax = FP32 + (w if w < FP32 else 0)  # the fp32 softmax output, and its cast back to a 16-bit dtype
        keeps_qkv, kept = not grouped, q if grouped else inputs
        core = w * 2 * q * grouped + heads * run.row_tokens * softmax
    elif core_kind == "spans" and latent is None:
        keeps_qkv, kept, core = False, 0.0, w * (q + k + v + out)  # the spans' copies of Q, K, V and the output
    elif core_kind == "spans":  # MLA's narrower values: torch's math path, in fp32, which keeps its softmax
        keeps_qkv, kept, core = False, 0.0, FP32 * (q + k + v) + heads * run.row_tokens * FP32
    else:  # sinks: the query's copy, K and V repeated to every head, the softmax over the keys and the sink
        keeps_qkv, kept, core = False, 0.0, w * 3 * q + heads * (run.row_tokens + 1) * w
    extra = compressed
    if shape.qk_norm and latent is None:  # per-head Q/K norms, whose outputs go to RoPE (which keeps none)
        if run.on_cpu and w < FP32:  # torch's norm in 16 bit: fp32 copies of Q and K, and them normalized
            extra += 2 * FP32 * (h_q + h_kv)
        else:  # the inputs: the query copied out of the grouped layout (a view without GQA), the key a view of QKV
            extra += w * h_q * grouped + (FP32 * (h_q + h_kv) if run.on_cpu else 0)  # torch's: normalized in fp32
            keeps_qkv = True
    return w * (out + kept + qkv * keeps_qkv) + core + extra, w * (out + inputs + qkv) + extra, core


def _mlp_bytes(shape: ModelShape, run: RolePasses, routed: bool) -> float:
    w, tp = WEIGHT_BYTES[run.dtype], run.tp
    t_sp = tp if run.sequence_parallel else 1
    if not routed:
        return w * 5 * shape.ffn / tp
    glu = 8 if shape.clamped_glu else 6
    experts = shape.top_k * (shape.hidden * (run.etp or tp) + glu * shape.expert_ffn) / tp
    shared = 5 * shape.shared_ffn / tp + (shape.hidden / t_sp if shape.shared_gate else 0)
    return w * (experts + shared) + (9 * shape.experts + 24 * shape.top_k) / t_sp
