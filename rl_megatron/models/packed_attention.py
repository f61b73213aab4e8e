"""Attention over packed sequences without Transformer Engine: the CPU's counterpart of TE's THD kernels.

A packed row holds several samples back to back; `PackedSeqParams.cu_seqlens_q` marks where each starts. On GPU,
TE's fused attention takes that layout directly (cu_seqlens, qkv_format "thd"), as NeMo-RL and slime run it.
Megatron's local `DotProductAttention` (what models are built from without TE) refuses packed input, so this
subclass computes each sample span on its own, causally within the span: each sample attends to itself only,
exactly as it would alone in a row of its own. Rotary embeddings restart at each span before attention (Megatron
applies them per span when cu_seqlens are given), so positions within a sample are its own.

Per span, with torch's fused scaled-dot-product attention (a flash kernel on CPU too): like TE's kernels it never
holds a span's score matrix, so a packed micro-batch's memory grows with its tokens, not with the square of its
longest sample. Unpacked rows keep Megatron's own path unless a sliding window is set (Mistral), whose mask
Megatron's local attention builds on CUDA only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention

# Without Transformer Engine, megatron-core still imports its TE extension (stand-ins for the missing classes) and
# MLA's `HAVE_TE` says True, so its fp8 check calls isinstance() with a stand-in; the extension's own flag is right.
multi_latent_attention.HAVE_TE = te_extension.HAVE_TE


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local attention, plus packed rows and sliding windows (whose mask Megatron's local path builds on
    CUDA only); both go through torch's fused attention, one sample span (or unpacked row) at a time."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        window = self.config.window_size
        if packed_seq_params is None and window is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # [tokens, batch, heads (query groups for key/value), head_dim]; Megatron squeezes a packed row's batch of 1.
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if packed_seq_params is not None:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        query, key, value = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [batch, heads, tokens, d]
        if groups > 1:
            key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
        tokens = query.shape[2]
        bounds = packed_seq_params.cu_seqlens_q.tolist() if packed_seq_params is not None else [0, tokens]
        spans = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                **causal(b - a, window, query.device), scale=self.softmax_scale)
                 for a, b in zip(bounds, bounds[1:])]
        out = torch.cat(spans, dim=2)  # [batch, heads, tokens, d]
        return out.permute(2, 0, 1, 3).reshape(tokens, out.shape[0], -1)  # [tokens, batch, heads * d]


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
    if window is None:
        return {"is_causal": True}
    position = torch.arange(length, device=device)
    behind = position[:, None] - position[None, :]
    return {"attn_mask": (behind >= 0) & (behind <= window[0])}


def packed_seq_params(cu_seqlens: list[int], device) -> PackedSeqParams:
    """Megatron's description of a packed row whose samples start at `cu_seqlens` (then the row's end)."""
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(cu_seqlens, cu_seqlens[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)
