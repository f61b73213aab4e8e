"""The Megatron layers of Qwen3-Next-style hybrids, from megatron-core's own modules and its local layers: its
GatedDeltaNet on the layers config.linear_attention_freq marks, attention with an output gate on the others, and
RMSNorms that scale by 1 + weight where config.layernorm_zero_centered_gamma says so (the config.json side:
models/linear_attention.py).

Three things megatron-core 0.16.1 lacks here, each answered in this module:

- its GatedDeltaNet imports its kernels from fla (flash-linear-attention) and refuses to build without it; fla does
  not import on a CPU-only torch. `bind_torch_kernels` puts models/gated_delta.py's torch functions, which take
  fla's arguments, in their place where fla is missing (fla's stay where it is installed);
- its GatedDeltaNet refuses packed rows. `PackedGatedDeltaNet` confines the convolution and the delta rule to each
  sample's span (cu_seqlens), so that each sample computes what it would alone;
- its local norm (torch's) refuses zero-centred weights, and the gated norm of the linear attention keeps a plain
  weight in Qwen3-Next (`RMSNorm`, one class for both).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from rl_megatron import platform
from rl_megatron.models import gated_delta


def bind_torch_kernels() -> None:
    """Where fla does not import, megatron-core's gated_delta_net module has no l2norm or chunk_gated_delta_rule and
    its GatedDeltaNet refuses to build (HAVE_FLA): models/gated_delta.py's functions take their place. The one place
    that patches that module; idempotent."""
    if not gated_delta_net.HAVE_FLA:
        gated_delta_net.l2norm = gated_delta.l2norm
        gated_delta_net.chunk_gated_delta_rule = gated_delta.chunk_gated_delta_rule
        gated_delta_net.HAVE_FLA = True


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension in float32, built as Megatron builds its norms. `zero_centred`: it scales by
    1 + weight, the weight starting at zero (Qwen3NextRMSNorm); otherwise by the weight, after the cast back to the
    input's dtype (Qwen3NextRMSNormGated's order)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        start = torch.zeros if zero_centred else torch.ones
        self.weight = torch.nn.Parameter(start(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            # Each TP rank sees its own tokens (or, after the linear attention, its own heads): Megatron sums the
            # gradient over the TP group for weights so marked, as it marks apex's and TE's norms. (Without sequence
            # parallelism at TP > 1 the gated norm's gradient would stay partial: `hybrid_block` refuses that.)
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


class EagerGateSelfAttention(SelfAttention):
    """Megatron's SelfAttention with its output gate applied without torch.compile, which Megatron wraps it in and
    which on the CPU builds a C++ kernel in every process for one multiply (as models.gpt.eager_quick_gelu)."""

    def _apply_output_gate(self, x, gate):
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


class PackedGatedDeltaNet(GatedDeltaNet):
    """Megatron's GatedDeltaNet (its parameters, their layout and checkpointing), with packed rows: a row of several
    samples (PackedSeqParams' cu_seqlens) runs the convolution and the delta rule within each sample's span. The
    convolution is models/gated_delta.py's on every device (four multiply-adds per element beside the projections;
    causal_conv1d's kernel takes span bounds only as channel-last seq_idx); the rule's: `kernels`."""

    def kernels(self):
        """(the delta rule, l2norm): megatron-core's module's (fla's, or ours where fla is missing), ours under
        config.deterministic_mode (fla's backward sums in no fixed order), as Megatron's own forward chooses."""
        if self.config.deterministic_mode:
            return gated_delta.chunk_gated_delta_rule, gated_delta.l2norm
        return gated_delta_net.chunk_gated_delta_rule, gated_delta_net.l2norm

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("GatedDeltaNet does not support Megatron's inference contexts.")
        projected, _ = self.in_proj(hidden_states)  # [s, b, h] in; sequence parallelism's shards gathered
        projected = projected.transpose(0, 1)  # [b, s, x]
        batch, length = projected.shape[:2]
        qk, v, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.num_v_heads_local_tp
        qkv, gate, beta, alpha = projected.split([2 * qk + v, v, heads, heads], -1)
        bounds = span_bounds(packed_seq_params)
        qkv = gated_delta.causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                        self.activation, bounds).transpose(1, 2)
        query, key, value = qkv.split([qk, qk, v], -1)
        query, key = (x.reshape(batch, length, -1, self.key_head_dim) for x in (query, key))
        value = value.reshape(batch, length, -1, self.value_head_dim)
        rule, normalize = self.kernels()
        if self.use_qk_l2norm:
            query, key = normalize(query.contiguous()), normalize(key.contiguous())
        shared = self.num_value_heads // self.num_key_heads  # value heads per key head
        if shared > 1:
            query, key = (x.repeat_interleave(shared, dim=2) for x in (query, key))
        decay = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # in float32, as transformers
        spans = {}
        if bounds is not None:  # ours reads the host's bounds; fla takes them on the device
            spans["cu_seqlens"] = bounds if rule is gated_delta.chunk_gated_delta_rule else \
                packed_seq_params.cu_seqlens_q.long()
        out, _ = rule(query.contiguous(), key.contiguous(), value.contiguous(), g=decay, beta=beta.sigmoid(),
                      initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **spans)
        gate = gate.reshape(batch, length, -1, self.value_head_dim)
        gated = (self.out_norm(out) * self.act_fn(gate.float())).to(out.dtype)
        return self.out_proj(gated.reshape(batch, length, -1).transpose(0, 1).contiguous())


def span_bounds(packed_seq_params) -> tuple[int, ...] | None:
    """A packed row's sample bounds on the host (models/packed_attention.HostPackedSeqParams carries them; another
    PackedSeqParams' are read back), None for unpacked rows."""
    if packed_seq_params is None:
        return None
    host = getattr(packed_seq_params, "host_cu_seqlens", None)
    return tuple(host) if host else tuple(packed_seq_params.cu_seqlens_q.tolist())


def hybrid_block(block: TransformerBlockSubmodules, config, vp_stage: int) -> TransformerBlockSubmodules:
    """`block`, this stage's layers of Megatron's local GPT spec, with a hybrid model's own: Gated DeltaNet on the
    layers config.linear_attention_freq marks (attention, with its output gate where config.attention_output_gate
    says, on the others) and RMSNorms zero-centred where config.layernorm_zero_centered_gamma says (the gated norm
    inside the linear attention keeps its plain weight)."""
    bind_torch_kernels()
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError("actor.sequence_parallel=false at TP > 1 with a Gated DeltaNet model: each TP rank's gated "
                         "norm sees only its heads, and Megatron sums its gradient over the ranks only with sequence "
                         "parallelism. Remove actor.sequence_parallel (on at TP > 1 by default) or set it to true.")
    norm = ModuleSpec(module=RMSNorm, params={"zero_centred": config.layernorm_zero_centered_gamma})
    linear = get_linear_attention_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    delta_net = ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))
    layers = []
    for index, spec in enumerate(block.layer_specs):
        layer = spec.submodules
        if linear[offset + index]:
            attention = delta_net
        else:
            attention = layer.self_attention
            if config.qk_layernorm:
                attention = replace(attention, submodules=replace(attention.submodules, q_layernorm=norm,
                                                                  k_layernorm=norm))
            if config.attention_output_gate and not platform.has_cuda():
                attention = replace(attention, module=EagerGateSelfAttention)
        layers.append(replace(spec, submodules=replace(layer, input_layernorm=norm, self_attention=attention,
                                                       pre_mlp_layernorm=norm)))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)
