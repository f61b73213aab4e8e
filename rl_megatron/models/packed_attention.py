"""Attention over packed sequences without Transformer Engine: the CPU's counterpart of TE's THD kernels.

A packed row holds several samples back to back; `PackedSeqParams.cu_seqlens_q` marks where each starts. On GPU,
TE's fused attention takes that layout directly (cu_seqlens, qkv_format "thd"), as NeMo-RL and slime run it.
Megatron's local `DotProductAttention` (what models are built from without TE) refuses packed input, so this
subclass computes each sample span on its own, causally within the span: each sample attends to itself only,
exactly as it would alone in a row of its own. Rotary embeddings restart at each span before attention (Megatron
applies them per span when cu_seqlens are given), so positions within a sample are its own.

Per span, with torch's fused scaled-dot-product attention (a flash kernel on CPU too): like TE's kernels it never
holds a span's score matrix, so a packed micro-batch's memory grows with its tokens, not with the square of its
longest sample. Unpacked rows keep Megatron's own path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # THD input: [tokens, heads (query groups for key/value), head_dim] (Megatron squeezed the batch of 1).
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        query, key, value = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, tokens, d]
        if groups > 1:
            key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        spans = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                                scale=self.softmax_scale) for a, b in zip(bounds, bounds[1:])]
        out = torch.cat(spans, dim=2)  # [1, heads, tokens, d]
        return out.squeeze(0).transpose(0, 1).reshape(out.shape[2], 1, -1)  # [tokens, 1, heads * d]


def packed_seq_params(cu_seqlens: list[int], device) -> PackedSeqParams:
    """Megatron's description of a packed row whose samples start at `cu_seqlens` (then the row's end)."""
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(cu_seqlens, cu_seqlens[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)
