"""Megatron's local attention over packed sequences: the CPU's counterpart of Transformer Engine's THD kernels.

A packed row holds several samples back to back; `PackedSeqParams.cu_seqlens_q` marks where each starts. On GPU,
TE's fused attention takes that layout directly (cu_seqlens, qkv_format "thd"), as NeMo-RL and slime run it.
Megatron's local `DotProductAttention` (what models are built from without TE) refuses packed input, so this
subclass runs it once per sample span, causally within the span: each sample attends to itself only, exactly as
it would alone in a row of its own. Rotary embeddings restart at each span before attention (Megatron applies
them per span when cu_seqlens are given), so positions within a sample are its own.

Per span rather than one block-diagonal mask over the row: the score matrix of a span is span², not row², so a
packed row costs what its samples cost unpacked.
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class PackedDotProductAttention(DotProductAttention):

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # THD input: [tokens, heads, head_dim] (Megatron squeezed the batch dimension of 1).
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        spans = [super(PackedDotProductAttention, self).forward(
            query[start:end].unsqueeze(1), key[start:end].unsqueeze(1), value[start:end].unsqueeze(1), None,
            attn_mask_type=AttnMaskType.causal) for start, end in zip(bounds, bounds[1:])]
        return torch.cat(spans)  # [tokens, 1, heads * head_dim / TP]


def packed_seq_params(cu_seqlens: list[int], device) -> PackedSeqParams:
    """Megatron's description of a packed row whose samples start at `cu_seqlens` (then the row's end)."""
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(cu_seqlens, cu_seqlens[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)
