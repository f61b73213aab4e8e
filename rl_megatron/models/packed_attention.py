"""Attention over packed sequences without Transformer Engine: the local counterpart of TE's THD kernels.

A packed row holds several samples back to back; `PackedSeqParams.cu_seqlens_q` marks where each starts. With TE,
its fused attention and RoPE take that layout directly (cu_seqlens, qkv_format "thd"), as NeMo-RL and slime run
it. Megatron's local `DotProductAttention` (what models are built from without TE) refuses packed input, so this
subclass computes causal attention confined to each sample span: each sample attends to itself only, exactly as it
would alone in a row of its own.

Nothing here waits for the device (docs/architecture.md, "The step's host/device boundary"): the span bounds
travel on the host with the packed parameters (`HostPackedSeqParams`), and rotary embeddings restart at each span
through per-token positions computed on the device (`packed_rotary`), where Megatron's unfused THD RoPE reads the
bounds back twice per layer. Two kernels (`varlen_call` picks one per call):

- on CUDA in fp16/bf16, one call per layer: torch's variable-length flash attention (`torch.nn.attention.varlen`)
  where the installed torch has it and its signature takes the call (`VARLEN_ARGS`, read argument by argument),
  the kernel torchtitan's varlen attention calls;
- elsewhere (CPU, float32, a window the kernel cannot take, MLA, sinks), torch's fused scaled-dot-product
  attention, one call per span length with the spans of that length as its batch (a flash kernel on CPU too: it
  never holds a span's score matrix, so memory grows with the row's tokens, not with the square of its longest
  sample).

Grouped-query attention shares each key/value head through `enable_gqa` where the kernel takes it; a varlen kernel
without it (torch 2.11) gets each key/value head repeated for its query heads (a copy, the same attention).
Under trainer.deterministic, only kernels with a deterministic backward run (`allowed_kernels`).

Unpacked rows keep Megatron's own path unless the layer has a sliding window (Mistral, gpt-oss), whose mask
Megatron's local attention builds on CUDA only, or attention sinks (gpt-oss: `attention_with_sinks`).
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import attention, multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import is_layer_window_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from rl_megatron.batch import to_device

try:  # torch >= 2.9 on CUDA: flash attention over cu_seqlens in one call
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

# Without Transformer Engine, megatron-core still imports its TE extension (stand-ins for the missing classes) and
# MLA's `HAVE_TE` says True, so its fp8 check calls isinstance() with a stand-in; the extension's own flag is right.
multi_latent_attention.HAVE_TE = te_extension.HAVE_TE
# The varlen kernel's parameters in the installed torch, each used where present (`varlen_call`): torch 2.9's takes
# is_causal and no scale; later releases take scale and window_size; enable_gqa came after 2.11.
VARLEN_ARGS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()
# Flash kernels, the varlen one included, take half precision only: a float32 call raises.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# SDPA's backends whose backward sums in a fixed order under torch's deterministic algorithms (strict, as
# platform/determinism.make_process_deterministic sets them): torch then runs flash's backward with FlashAttention's
# deterministic flag and the memory-efficient one with a single key split (aten's attention_backward.cu); cuDNN's
# has no such path (torch's own SDPA choice drops it there too). Without those settings only the math backend is.
ORDERED_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class Kernels(NamedTuple):
    """The attention kernels a layer may run: the varlen one or not, and SDPA's backends (None: any)."""
    varlen: bool
    sdpa: tuple[SDPBackend, ...] | None


def allowed_kernels(deterministic: bool, strict: bool) -> Kernels:
    """`deterministic`: trainer.deterministic (Megatron's deterministic_mode); `strict`: torch's deterministic
    algorithms are on and not warn-only. With both, the flash backward (SDPA's and the varlen kernel's, which calls
    the same aten op) takes its deterministic path; deterministic without strict leaves only SDPA's math backend,
    whose backward is plain matmuls (scores held per span: memory grows with the square of its length)."""
    if not deterministic:
        return Kernels(varlen=True, sdpa=None)
    return Kernels(varlen=True, sdpa=ORDERED_SDPA) if strict else Kernels(varlen=False, sdpa=(SDPBackend.MATH,))


def strict_determinism() -> bool:
    """Whether torch's deterministic algorithms are on, raising on ops without a deterministic kernel."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


@dataclass(frozen=True)
class VarlenCall:
    """How the varlen kernel takes one layer's call: its keyword arguments, and whether key/value heads are
    repeated up to the query's (a kernel without `enable_gqa` wants as many as the query has)."""
    kwargs: dict = field(default_factory=dict)
    expand_kv: bool = False


def varlen_call(device: str, dtype: torch.dtype, takes: frozenset[str], window: tuple[int, int] | None, gqa: bool,
                scale: float, allowed: bool = True) -> VarlenCall | None:
    """The varlen kernel's call for a packed layer on `device` (its type) in `dtype`, with the kernel's parameters
    `takes` (VARLEN_ARGS), or None where SDPA takes it: not CUDA, not half precision, not `allowed`
    (`allowed_kernels`), or a parameter the call needs missing (scale; the window's or causality's)."""
    if not allowed or device != "cuda" or dtype not in FLASH_DTYPES or "scale" not in takes:
        return None
    if "window_size" in takes:  # (before, 0): causal within the window; (-1, 0): causal
        kwargs = {"window_size": (window[0] if window is not None else -1, 0)}
    elif window is None and "is_causal" in takes:
        kwargs = {"is_causal": True}
    else:
        return None
    kwargs["scale"] = scale
    if "enable_gqa" in takes:
        return VarlenCall({**kwargs, "enable_gqa": gqa})
    return VarlenCall(kwargs, expand_kv=gqa)


def run_varlen(query, key, value, packed: PackedSeqParams, call: VarlenCall) -> torch.Tensor:
    """One varlen call over a packed row: [tokens, heads (query groups for key/value), d] in, [tokens, 1, heads * d]
    out."""
    if call.expand_kv:
        # Query head h reads key/value head h // (heads / groups), as Megatron groups them and SDPA's enable_gqa
        # shares them: repeating each that many times in place is the same attention.
        repeats = query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(repeats, dim=1) for x in (key, value))
    out = varlen_attn(query, key, value, packed.cu_seqlens_q, packed.cu_seqlens_kv, packed.max_seqlen_q,
                      packed.max_seqlen_kv, **call.kwargs)
    return out.reshape(out.shape[0], 1, -1)


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's packed-row parameters, plus the span bounds as the host knows them (no read-back)."""
    host_cu_seqlens: tuple[int, ...] = ()


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local attention, plus packed rows, sliding windows (whose mask Megatron's local path builds on
    CUDA only; per layer where config.window_attn_skip_freq says which) and attention sinks."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.window = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None
        if self.softmax_offset is not None:
            # Megatron draws each TP rank's sinks from its own generator; zero is the same model at every layout
            # (weights loaded afterwards replace it).
            with torch.no_grad():
                self.softmax_offset.zero_()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None and self.window is None and self.softmax_offset is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        kernels = allowed_kernels(self.config.deterministic_mode, strict_determinism())
        return packed_attention(query, key, value, packed_seq_params, self.softmax_scale, self.window,
                                self.softmax_offset, kernels)


def packed_attention(query, key, value, packed: HostPackedSeqParams | None, scale: float,
                     window: tuple[int, int] | None = None, sinks: torch.Tensor | None = None,
                     kernels: Kernels = Kernels(varlen=True, sdpa=None)) -> torch.Tensor:
    """Causal attention within each span of a packed row ([tokens, heads, d]; `packed` its bounds) or within each
    row ([tokens, batch, heads, d]; `packed` None). Key/value may hold fewer (grouped) heads. Out: [tokens, batch,
    heads * d]."""
    gqa = query.shape[-2] != key.shape[-2]
    # (MLA's values are narrower than its queries and keys: flash kernels want one head width.)
    if packed is not None and sinks is None and query.shape[-1] == value.shape[-1]:
        call = varlen_call(query.device.type, query.dtype, VARLEN_ARGS, window, gqa, scale, kernels.varlen)
        if call is not None:
            return run_varlen(query, key, value, packed, call)
    # [tokens, batch, heads (query groups for key/value), head_dim]; Megatron squeezes a packed row's batch of 1.
    if packed is not None:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
    query, key, value = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [batch, heads, tokens, d]
    tokens = query.shape[2]
    bounds = packed.host_cu_seqlens if packed is not None else (0, tokens)
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    # split, not slicing: its backward joins the spans' gradients instead of a zero row per span.
    spans = list(zip(*(x.split(lengths, dim=2) for x in (query, key, value))))
    outputs = [None] * len(spans)
    # The backward runs the kernel the forward picked: pinning the forward's backends pins the backward's.
    with sdpa_kernel(list(kernels.sdpa)) if kernels.sdpa is not None else nullcontext():
        for length, group in _by_length(lengths).items():
            # The spans of one length as the batch of one call (in a packed row of short samples most share a few
            # lengths): the same kernel per (sample, head) as a call per span, with a fraction of the calls.
            q, k, v = (torch.cat([spans[i][part] for i in group]) for part in range(3))
            if sinks is None:
                out = F.scaled_dot_product_attention(q, k, v, **causal(length, window, q.device), scale=scale,
                                                     enable_gqa=gqa)
            else:
                out = attention_with_sinks(q, k, v, causal_mask(length, window, q.device), scale, sinks)
            for i, span_out in zip(group, out.split(query.shape[0])):
                outputs[i] = span_out
    out = torch.cat(outputs, dim=2)  # [batch, heads, tokens, d]
    return out.permute(2, 0, 1, 3).reshape(tokens, out.shape[0], -1)  # [tokens, batch, heads * d]


def attention_with_sinks(query, key, value, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax over each query's keys also holds its head's sink logit, a column that takes
    probability and gives no value (gpt-oss; transformers' eager attention). No fused kernel takes the sink here,
    so the scores are formed explicitly: memory grows with the square of the span (TE's attention takes sinks
    fused on GPU). [batch, heads, tokens, d] in and out; key/value may hold fewer (grouped) heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
    return probs @ value


def _by_length(lengths: list[int]) -> dict[int, list[int]]:
    """The indices of the spans of each length, in order."""
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    return groups


class LatentDotProductAttention(PackedDotProductAttention):
    """The local core attention of MLA layers: queries and keys of nope + rope dimensions, values of v_head_dim,
    which Megatron's DotProductAttention (sized by kv_channels alone) does not take. MLA hands packed rows over
    as [tokens, heads, d], as the packed path expects."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def causal(length: int, window: tuple[int, int] | None, device) -> dict:
    """Scaled-dot-product attention's arguments for causal attention over `length` positions, within Megatron's
    `window_size` (positions before, positions after: 0, causal) where set."""
    return {"is_causal": True} if window is None else {"attn_mask": causal_mask(length, window, device)}


def causal_mask(length: int, window: tuple[int, int] | None, device) -> torch.Tensor:
    """[length, length]: whether each query position sees each key position (before it, within `window`)."""
    position = torch.arange(length, device=device)
    behind = position[:, None] - position[None, :]
    return (behind >= 0) & (behind <= (window[0] if window is not None else length))


def packed_seq_params(cu_seqlens: list[int], device) -> HostPackedSeqParams:
    """Megatron's description of a packed row whose samples start at `cu_seqlens` (then the row's end): the bounds
    on the device for the kernels, and on the host for the code that loops over spans."""
    bounds = to_device(torch.tensor(cu_seqlens, dtype=torch.int32), device)
    longest = max(end - start for start, end in zip(cu_seqlens, cu_seqlens[1:]))
    return HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                               max_seqlen_kv=longest, host_cu_seqlens=tuple(cu_seqlens))


def span_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The position of each of a packed row's `tokens` within its span, computed on the device (no read-back)."""
    index = torch.arange(tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    starts = cu_seqlens[torch.searchsorted(cu_seqlens, index, right=True) - 1]
    return (index - starts).long()


class PackedRotary:
    """Megatron's `apply_rotary_pos_emb`, with a packed row's unfused RoPE done without host syncs: each token takes
    the frequencies of its position within its span, which is what Megatron's THD path computes after reading the
    span lengths back. Fused RoPE (TE) and context parallelism keep Megatron's path. The positions of the last row
    are kept: every layer (and q and k) of one forward pass passes the same cu_seqlens tensor."""

    def __init__(self):
        self._row: tuple[torch.Tensor, torch.Tensor] | None = None

    def positions(self, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
        if self._row is None or self._row[0] is not cu_seqlens or self._row[1].shape[0] != tokens:
            self._row = (cu_seqlens, span_positions(cu_seqlens, tokens))
        return self._row[1]

    def __call__(self, t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        context = cp_group.size() if cp_group is not None else 1
        if cu_seqlens is None or config.apply_rope_fusion or context > 1:
            return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                                                   cp_group=cp_group)
        packed = freqs[self.positions(cu_seqlens, t.shape[0])]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), packed, rotary_interleaved=config.rotary_interleaved,
            multi_latent_attention=config.multi_latent_attention, mscale=mscale).squeeze(1)


# The attention modules call the RoPE by the name they imported.
attention.apply_rotary_pos_emb = multi_latent_attention.apply_rotary_pos_emb = PackedRotary()
