"""vLLM's Gated DeltaNet layers (Qwen3-Next's and Qwen3.5's linear attention) on CPU, computed by the project's torch
kernels (models/gated_delta.py) over vLLM's own state caches.

vLLM 0.32's CPU kernels for these layers take bfloat16 alone (the demo's engines, like the trainer, compute in
float32), linear key and value heads whose widths are multiples of 32, and on CPUs with AVX512-BF16 they pack the
convolution's weight in place after loading, where a weight sync could not write it (`cpu_engine.py` keeps it as
loaded). Here each step's tokens are taken request by request, as vLLM lays them out (decodes first, then prefills,
spans bounded by the query start locations): a request's convolution continues from the last `width - 1` inputs
its cache slot holds, and its delta rule from the recurrent state there, when it has run before (zeros otherwise);
both are written back for its next step. Engines run eagerly on CPU, so the layer is called directly, outside
vLLM's custom op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_megatron.models.gated_delta import causal_conv1d, chunk_gated_delta_rule


def run_gated_delta_net_in_torch() -> None:
    """Every Gated DeltaNet layer vLLM builds from now on in this process computes with `forward_in_torch`."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    QwenGatedDeltaNetAttention.forward_cpu = forward_in_torch


def forward_in_torch(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """The layer's output for this step's tokens (`hidden_states` [tokens, hidden]): vLLM's projections and its
    gated norm, with the convolution and the delta rule computed here."""
    from vllm.forward_context import get_forward_context

    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    mixed_ba, _ = layer.in_proj_ba(hidden_states)
    # mixed_qkv: [q | k | v] per token, in the channel order of the convolution's weight.
    if layer.gqa_interleaved_layout:  # Qwen3-Next: each key head's q, k, v, z (and b, a) together
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, mixed_ba)
        mixed_qkv = torch.cat([part.flatten(-2) for part in (query, key, value)], -1)
    else:  # Qwen3.5: [q | k | v | z] and [b | a] of this rank's heads, each part whole
        mixed_qkv, z = mixed_qkvz.split([layer.conv_dim // layer.tp_size, layer.value_dim // layer.tp_size], -1)
        z = z.unflatten(-1, (-1, layer.head_v_dim))
        b, a = layer.split_ba(mixed_ba)
    core = mixed_qkv.new_zeros(hidden_states.shape[0], layer.num_v_heads // layer.tp_size, layer.head_v_dim)
    metadata = get_forward_context().attn_metadata
    if metadata is not None:  # None in vLLM's profiling run, which only measures memory
        _core(layer, metadata[layer.prefix], mixed_qkv, b, a, core)
    return layer._output_projection(core, z)


def _core(layer, metadata, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """The convolution and the delta rule over the step's requests (`metadata`: vLLM's GDNAttentionMetadata),
    written into `out` [tokens, value heads, value width]; each request's caches updated."""
    requests = metadata.num_decodes + metadata.num_prefills
    bounds = metadata.non_spec_query_start_loc[:requests + 1]
    slots = metadata.non_spec_state_indices_tensor[:requests].long()
    # Decodes always continue a request; has_initial_state is only built when some request prefills.
    has_state = (torch.ones(requests, dtype=torch.bool) if metadata.has_initial_state is None
                 else metadata.has_initial_state[:requests])
    tokens = int(bounds[-1])
    convolved = _convolve(layer, mixed_qkv[:tokens], bounds.tolist(), slots, has_state)
    local_key = layer.key_dim // layer.tp_size
    query, key, value = convolved.split([local_key, local_key, layer.value_dim // layer.tp_size], -1)
    # Each key head serves num_v_heads / num_k_heads value heads in a row (as transformers and fla pair them).
    per_key = layer.num_v_heads // layer.num_k_heads
    query, key = (x.unflatten(-1, (-1, layer.head_k_dim)).repeat_interleave(per_key, 1) for x in (query, key))
    value = value.unflatten(-1, (-1, layer.head_v_dim))
    decay = -layer.A_log.float().exp() * F.softplus(a[:tokens].float() + layer.dt_bias.float())
    write = b[:tokens].float().sigmoid()
    # vLLM's state slots are [value heads, value width, key width]; only this module reads or writes them, as
    # [value heads, key width, value width] (fla's layout, as vLLM's CPU kernels view them too).
    cache = layer.kv_cache[1]
    states = cache.view(*cache.shape[:2], layer.head_k_dim, layer.head_v_dim)
    # where, not a product: a slot no request has used yet holds whatever its memory held (NaN * 0 is NaN).
    initial = torch.where(has_state[:, None, None, None], states[slots].float(), 0.0)
    result, final = chunk_gated_delta_rule(query[None], key[None], value[None], decay[None], write[None],
                                           initial_state=initial, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    states[slots] = final.to(states.dtype)
    out[:tokens] = result[0].to(out.dtype)


def _convolve(layer, mixed_qkv: torch.Tensor, bounds: list[int], slots: torch.Tensor,
              has_state: torch.Tensor) -> torch.Tensor:
    """The causal convolution (and its activation) of each request's tokens [tokens, channels], continued from the
    inputs its cache slot keeps ([channels, width - 1] per slot in vLLM's "DS" layout, transposed otherwise); the
    slot then keeps the request's last width - 1 inputs."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    weight = layer.conv1d.weight[:, 0]  # [channels, width]
    conv_states = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    kept = weight.shape[-1] - 1
    outputs = []
    for request, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        slot = slots[request]
        history = conv_states[slot] if has_state[request] else mixed_qkv.new_zeros(mixed_qkv.shape[1], kept)
        inputs = torch.cat([history.to(mixed_qkv.dtype), mixed_qkv[start:stop].T], -1)
        outputs.append(causal_conv1d(inputs[None], weight, layer.conv1d.bias, layer.activation)[0, :, kept:].T)
        conv_states[slot] = inputs[:, -kept:].to(conv_states.dtype)
    return torch.cat(outputs)
