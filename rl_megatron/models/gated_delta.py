"""The Gated DeltaNet core of Qwen3-Next and Qwen3.5 in plain torch: the short causal depthwise convolution over
q/k/v and the chunked gated delta rule, on any device, and confined to each sample of a packed row.

Megatron-core's `GatedDeltaNet` calls three CUDA kernels: `causal_conv1d_fn` (package causal_conv1d),
`chunk_gated_delta_rule` and `l2norm` (package fla, flash-linear-attention). Neither package imports on a CPU-only
torch, and megatron-core 0.16.1 refuses packed rows in that layer. The functions here take those kernels' arguments
(names, order, layouts), so that they can stand in for them, plus `cu_seqlens` (flash-attn's convention: the start
of each sample's span in the row, then the row's end) wherever a packed row needs it:

- `causal_conv1d(x, weight, bias, activation, cu_seqlens)`: x is [batch, channels, time] as causal_conv1d_fn and
  transformers' torch path take it; with `cu_seqlens` no tap reaches back across a span's start.
- `chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
  cu_seqlens)`: fla's argument order and layouts (q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; states
  [N, H, K, V]); with `cu_seqlens` (batch 1, as fla wants it) the recurrent state starts afresh in every span.
- `l2norm(x)`: what megatron normalizes q and k with before the rule.

The rule, per head, with the state S a [K, V] matrix, the queries scaled by `scale`:
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t.
The chunked form (DeltaNet's WY/UT transform, as transformers' `torch_chunk_gated_delta_rule` and fla compute it)
solves each chunk's writes with one triangular solve, then carries the state from chunk to chunk: a Python loop of
T / chunk_size steps instead of T. Everything runs in float32; the output comes back in the queries' dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")  # what causal_conv1d_fn accepts; Qwen3-Next uses silu


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over the square root of (its squared norm along the last dimension + eps), in float32 (as fla's l2norm
    computes it), returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None,
                  cu_seqlens: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over time: out[:, c, t] = bias[c] + sum_j weight[c, -1 - j] * x[:, c, t - j],
    then the activation. x [batch, channels, time], weight [channels, width], bias [channels] or None. With
    `cu_seqlens` (every row split at the same bounds), inputs before a token's span start count as zeros: each
    sample is convolved as if alone. Computed in weight's dtype, returned in x's."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    time, width = x.shape[-1], weight.shape[-1]
    inputs = x.to(weight.dtype)
    position = None if cu_seqlens is None else positions_in_spans(time, cu_seqlens, x.device)
    out = inputs * weight[:, -1:]  # the current token's tap
    for lag in range(1, width):
        earlier = F.pad(inputs, (lag, 0))[..., :time]  # the token `lag` steps back; zeros before the row
        if position is not None:
            earlier = earlier * (position >= lag)  # ... and before the token's own span
        out = out + earlier * weight[:, -1 - lag, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def positions_in_spans(time: int, cu_seqlens: Sequence[int] | torch.Tensor, device) -> torch.Tensor:
    """Each token's offset from the start of its span ([time], on `device`); tokens past the last bound form one
    more span. Computed on the device: nothing waits for it."""
    bounds = torch.as_tensor(cu_seqlens, device=device)
    token = torch.arange(time, device=device)
    span = torch.searchsorted(bounds, token, right=True) - 1
    return token - bounds[span]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Sequence[int] | torch.Tensor | None = None, *,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (module docstring) over q, k [B, T, H, K], v [B, T, H, V], g (log decay, <= 0) and
    beta [B, T, H]; q/k/v with the same heads (repeat grouped q/k heads first, as megatron and transformers do).
    `scale` defaults to K ** -0.5, applied after the optional L2 normalization of q and k.

    Without `cu_seqlens`, each row is one sequence: states [B, H, K, V]. With it, B must be 1 and the row holds
    N = len(cu_seqlens) - 1 samples, its bounds ending at T: each starts from its own initial state (zeros when
    `initial_state` is None), and states are [N, H, K, V]. A tensor `cu_seqlens` is read back to the host; a list
    (the micro-batch's own) is not.

    Returns the output [B, T, H, V] in q's dtype, and the float32 final states if `output_final_state`."""
    if v.shape[2] != q.shape[2] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k and v need the same number of heads, not {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    out_dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (k.shape[-1] ** -0.5 if scale is None else scale)
    if initial_state is not None:
        initial_state = initial_state.float()
    if cu_seqlens is None:
        out, state = _rule_over_rows(q, k, v, g, beta, initial_state, chunk_size)
    else:
        spans = span_lengths(cu_seqlens, q.shape[0], q.shape[1])
        if initial_state is not None and initial_state.shape[0] != len(spans):
            raise ValueError(f"{len(spans)} spans need as many initial states, not {initial_state.shape[0]}")
        # One sample per row, right-padded: trailing padding (g = 0, k = v = beta = 0) leaves outputs before it
        # and the carried state unchanged.
        samples = (_unpack(x, spans) for x in (q, k, v, g, beta))
        out, state = _rule_over_rows(*samples, initial_state, chunk_size)
        out = torch.cat([row[:length] for row, length in zip(out, spans)]).unsqueeze(0)
    return out.to(out_dtype), (state if output_final_state else None)


def span_lengths(cu_seqlens: Sequence[int] | torch.Tensor, batch: int, time: int) -> list[int]:
    """The lengths of the spans `cu_seqlens` bounds in a packed row of `time` tokens (checked)."""
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if batch != 1:
        raise ValueError(f"a packed row (cu_seqlens) comes as a batch of 1, not {batch}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != time:
        raise ValueError(f"cu_seqlens must run from 0 to the row's {time} tokens, not {bounds}")
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    if min(lengths) < 0:
        raise ValueError(f"cu_seqlens must not decrease: {bounds}")
    return lengths


def _unpack(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A packed row [1, T, ...] as one right-padded (zeros) row per span: [N, longest, ...]."""
    return torch.nn.utils.rnn.pad_sequence(list(x[0].split(lengths)), batch_first=True)


def _rule_over_rows(q, k, v, g, beta, initial_state, chunk_size):
    """The rule over whole rows of float32 inputs ([B, T, H, ...], q scaled): pads T to whole chunks, scans them,
    and returns (out [B, T, H, V], final state [B, H, K, V])."""
    batch, time, heads, k_dim = k.shape
    pad = -time % chunk_size
    # Heads first: [B, H, T, ...], the padding (zeros) after the last token.
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    state = q.new_zeros(batch, heads, k_dim, v.shape[-1]) if initial_state is None else initial_state
    out, state = _scan_chunks(q, k, v, g, beta, state, chunk_size)
    return out[:, :, :time].transpose(1, 2), state


def _scan_chunks(q, k, v, g, beta, state, chunk_size):
    """The chunked rule over [B, H, T, ...] (T whole chunks), from `state` [B, H, K, V]. Within a chunk, with
    D_i = g_1 + ... + g_i (the log decay since the chunk's start) and S0 the entering state, the writes
    delta_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) solve the unit lower triangular system
        delta_i + sum_{j<i} beta_i exp(D_i - D_j) (k_i . k_j) delta_j = beta_i v_i - beta_i exp(D_i) S0^T k_i,
    i.e. delta = U - W S0; then o_i = exp(D_i) S0^T q_i + sum_{j<=i} exp(D_i - D_j) (q_i . k_j) delta_j and
    the state leaving the chunk is exp(D_C) S0 + sum_j exp(D_C - D_j) k_j delta_j^T."""
    batch, heads, time, k_dim = k.shape
    chunks = time // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))
    log_decay = g.cumsum(-1)
    # decay_from[..., i, j] = exp(D_i - D_j) for j <= i; later j are masked before exp, where D_i - D_j > 0 could
    # overflow.
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay_from = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # unitriangular: the solve reads the diagonal as ones and only the strictly lower part (earlier tokens).
    system = (k_beta @ k.transpose(-1, -2)) * decay_from
    writes = torch.linalg.solve_triangular(
        system, torch.cat([v * beta.unsqueeze(-1), k_beta * log_decay.exp().unsqueeze(-1)], -1),
        upper=False, unitriangular=True)
    fresh_writes, state_reads = writes.split([v.shape[-1], k_dim], -1)  # U and W
    scores = (q @ k.transpose(-1, -2)) * decay_from  # causal within the chunk, the diagonal included
    q_from_start = q * log_decay.exp().unsqueeze(-1)
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    chunk_decay = log_decay[..., -1].exp()[..., None, None]
    outs = []
    for c in range(chunks):
        delta = fresh_writes[:, :, c] - state_reads[:, :, c] @ state
        outs.append(q_from_start[:, :, c] @ state + scores[:, :, c] @ delta)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    return torch.stack(outs, 2).reshape(batch, heads, time, -1), state
