"""The torch Gated DeltaNet core (models/gated_delta.py): the same numbers as transformers' Qwen3-Next torch path
(its fallback when flash-linear-attention and causal_conv1d are absent, as here) in float32, to 1e-5 absolute, and
as a token-by-token recurrence; packed rows give each sample exactly (1e-6) what it gives alone, and a predecessor's
content never reaches the next sample, forward or backward; a whole transformers `Qwen3NextGatedDeltaNet` layer is
rebuilt from these functions with its weights."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from rl_megatron.models.gated_delta import causal_conv1d, chunk_gated_delta_rule, l2norm

ATOL = 1e-5  # float32 agreement with transformers, outputs and states
PACKED_ATOL = 1e-6  # a packed sample against the same sample alone
GRAD_ATOL = 1e-5  # gradients (measured 5e-7)
HEADS, K_DIM, V_DIM, CHANNELS, WIDTH = 2, 16, 8, 12, 4


def rule_inputs(length, batch=1, seed=0, initial=False):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, HEADS, K_DIM, generator=generator) for _ in range(2))
    v = torch.randn(batch, length, HEADS, V_DIM, generator=generator)
    g = -2 * torch.rand(batch, length, HEADS, generator=generator)  # log decays, as -exp(A_log) * softplus(...)
    beta = torch.rand(batch, length, HEADS, generator=generator)
    state = torch.randn(batch, HEADS, K_DIM, V_DIM, generator=generator) if initial else None
    return q, k, v, g, beta, state


def conv_inputs(length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, CHANNELS, length, generator=generator), torch.randn(CHANNELS, WIDTH, generator=generator),
            torch.randn(CHANNELS, generator=generator))


def recurrent_reference(q, k, v, g, beta, state):
    """The rule as its definition reads, one token at a time: q, k already normalized and q scaled; [B, T, H, ...]."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        write = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, 1), state


def pack(parts):
    """Samples [1, T_i, ...] as one packed row, with their cu_seqlens."""
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + part.shape[1])
    return torch.cat(parts, 1), bounds


@pytest.mark.parametrize("length, chunk_size", [(1, 64), (5, 64), (64, 64), (100, 64), (150, 64), (37, 16)])
@pytest.mark.parametrize("normalize", [True, False])
def test_rule_matches_transformers(length, chunk_size, normalize):
    q, k, v, g, beta, state = rule_inputs(length, batch=2, initial=True)
    if not normalize:  # unnormalized keys make the delta rule diverge: give it unit keys, as the model does
        q, k = l2norm(q), l2norm(k)
    expected, expected_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=chunk_size, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=normalize)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                        use_qk_l2norm_in_kernel=normalize, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [3, 40, 70])
def test_chunks_match_the_token_by_token_recurrence(length):
    q, k, v, g, beta, state = rule_inputs(length, batch=2, initial=True)
    expected, expected_state = recurrent_reference(l2norm(q) * K_DIM ** -0.5, l2norm(k), v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, chunk_size=16)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [1, 3, 50])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_matches_transformers(length, with_bias):
    x, weight, bias = conv_inputs(length)
    bias = bias if with_bias else None
    expected = hf.causal_conv1d_fn(x, weight, bias, activation="silu")
    torch.testing.assert_close(causal_conv1d(x, weight, bias, "silu"), expected, atol=ATOL, rtol=0)
    # The layer's own nn.Conv1d (megatron's path without causal_conv1d), without an activation.
    module = torch.nn.Conv1d(CHANNELS, CHANNELS, WIDTH, groups=CHANNELS, padding=WIDTH - 1, bias=with_bias)
    module.weight.data = weight.unsqueeze(1)
    if with_bias:
        module.bias.data = bias
    torch.testing.assert_close(causal_conv1d(x, weight, bias), module(x)[..., :length], atol=ATOL, rtol=0)


def test_megatrons_keyword_calls_take_the_kernels_arguments():
    """megatron-core calls fla's and causal_conv1d's functions by these keywords, in bf16 (fla takes no float32)."""
    q, k, v, g, beta, _ = rule_inputs(20)
    out, state = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g=g, beta=beta.bfloat16(),
                                        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)
    assert out.dtype == torch.bfloat16 and out.shape == v.shape and state is None
    x, weight, bias = conv_inputs(9)
    assert causal_conv1d(x=x.bfloat16(), weight=weight, bias=bias, activation="silu").dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_samples_give_what_each_gives_alone(chunk_size):
    lengths = [7, 40, 23]  # shorter than, across and not a multiple of a chunk
    samples = [rule_inputs(length, seed=i, initial=True) for i, length in enumerate(lengths)]
    packed = [pack([s[field] for s in samples])[0] for field in range(5)]
    bounds = pack([s[0] for s in samples])[1]
    states = torch.cat([s[5] for s in samples])
    out, finals = chunk_gated_delta_rule(*packed, initial_state=states, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=bounds, chunk_size=chunk_size)
    for i, sample in enumerate(samples):
        alone, final = chunk_gated_delta_rule(*sample[:5], initial_state=sample[5], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
        torch.testing.assert_close(out[:, bounds[i]:bounds[i + 1]], alone, atol=PACKED_ATOL, rtol=0)
        torch.testing.assert_close(finals[i:i + 1], final, atol=PACKED_ATOL, rtol=0)
    # cu_seqlens as fla takes it (a LongTensor), and zero initial states by default
    zero_start, _ = chunk_gated_delta_rule(*packed, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds))
    alone, _ = chunk_gated_delta_rule(*samples[1][:5], use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(zero_start[:, bounds[1]:bounds[2]], alone, atol=PACKED_ATOL, rtol=0)


def test_packed_conv_gives_what_each_sample_gives_alone():
    samples = [conv_inputs(length, seed=i)[0] for i, length in enumerate([2, 30, 5])]  # one shorter than the kernel
    _, weight, bias = conv_inputs(1)
    row, bounds = pack([s.transpose(1, 2) for s in samples])
    out = causal_conv1d(row.transpose(1, 2), weight, bias, "silu", cu_seqlens=bounds)
    for i, sample in enumerate(samples):
        torch.testing.assert_close(out[..., bounds[i]:bounds[i + 1]], causal_conv1d(sample, weight, bias, "silu"),
                                   atol=PACKED_ATOL, rtol=0)


def test_a_predecessor_never_reaches_the_next_sample():
    """What would leak (the recurrent state, the convolution's taps) does so without cu_seqlens and not with it."""
    first, second = rule_inputs(30, seed=1), rule_inputs(20, seed=2)
    changed = rule_inputs(30, seed=3)

    def second_output(predecessor, cu_seqlens):
        row = [torch.cat([predecessor[f], second[f]], 1) for f in range(5)]
        out, _ = chunk_gated_delta_rule(*row, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, chunk_size=16)
        return out[:, 30:]

    assert (second_output(first, None) - second_output(changed, None)).abs().max() > 1e-2
    assert torch.equal(second_output(first, [0, 30, 50]), second_output(changed, [0, 30, 50]))

    (x, weight, _), (other, _, _) = conv_inputs(10, seed=1), conv_inputs(10, seed=2)
    x_changed = torch.cat([other[..., :4], x[..., 4:]], -1)  # a new first sample of 4 tokens, the same second
    for cu_seqlens, leaks in ((None, True), ([0, 4, 10], False)):
        difference = causal_conv1d(x, weight, None, "silu", cu_seqlens) - causal_conv1d(x_changed, weight, None,
                                                                                          "silu", cu_seqlens)
        assert (difference[..., 4:].abs().max() > 1e-3) == leaks


def test_gradients_match_transformers_and_stay_within_each_sample():
    q, k, v, g, beta, state = rule_inputs(45, batch=2, initial=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    hf_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    weights = torch.randn(2, 45, HEADS, V_DIM, generator=torch.Generator().manual_seed(9))
    out, final = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, chunk_size=16)
    expected, expected_final = hf.torch_chunk_gated_delta_rule(
        *hf_leaves[:3], g=hf_leaves[3], beta=hf_leaves[4], chunk_size=16, initial_state=hf_leaves[5],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((out * weights).sum() + final.sum()).backward()
    ((expected * weights).sum() + expected_final.sum()).backward()
    for mine, theirs in zip(leaves, hf_leaves):
        assert torch.isfinite(mine.grad).all()
        torch.testing.assert_close(mine.grad, theirs.grad, atol=GRAD_ATOL, rtol=0)

    # Packed: the second sample's output depends on nothing of the first, through the rule and the convolution.
    row = [x[:1].clone().requires_grad_() for x in (q, k, v, g, beta)]
    out, _ = chunk_gated_delta_rule(*row, use_qk_l2norm_in_kernel=True, cu_seqlens=[0, 17, 45], chunk_size=16)
    out[:, 17:].sum().backward()
    assert all(x.grad[:, :17].abs().max() == 0 and x.grad[:, 17:].abs().max() > 0 for x in row)
    x, weight, bias = (t.requires_grad_() for t in conv_inputs(12))
    causal_conv1d(x, weight, bias, "silu", cu_seqlens=[0, 5, 12])[..., 5:].sum().backward()
    assert x.grad[..., :5].abs().max() == 0 and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("cu_seqlens, batch, message", [
    ([0, 10, 20], 2, "batch of 1"),
    ([0, 10, 19], 1, "run from 0"),
    ([0, 12, 10, 20], 1, "not decrease"),
])
def test_packed_rows_are_checked(cu_seqlens, batch, message):
    q, k, v, g, beta, _ = rule_inputs(20, batch=batch)
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)


def test_packed_rows_need_one_initial_state_per_sample():
    q, k, v, g, beta, state = rule_inputs(20, initial=True)
    with pytest.raises(ValueError, match="initial states"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, cu_seqlens=[0, 10, 20])


# A tiny Qwen3-Next linear-attention layer: two key heads, each shared by two value heads.
LAYER_CONFIG = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                    layer_types=["linear_attention"], rms_norm_eps=1e-6, hidden_act="silu")


@pytest.fixture
def hf_layer():
    torch.manual_seed(0)
    layer = hf.Qwen3NextGatedDeltaNet(Qwen3NextConfig(**LAYER_CONFIG), layer_idx=0)
    with torch.no_grad():  # away from the initial values, so that each weight's role shows
        layer.dt_bias.normal_()
        layer.norm.weight.normal_()
    return layer


def layer_from_parts(layer, hidden, cu_seqlens=None):
    """Qwen3NextGatedDeltaNet.forward (no cache) from its weights and this module's functions: the projections
    grouped per key head ([q, k, v, z] and [b, a] for each), the convolution over [q, k, v], the decay
    g = -exp(A_log) * softplus(a + dt_bias), the rule, then the gated RMSNorm (weight * norm(out) * silu(z))."""
    key_heads, value_heads = LAYER_CONFIG["linear_num_key_heads"], LAYER_CONFIG["linear_num_value_heads"]
    k_dim, v_dim, group = LAYER_CONFIG["linear_key_head_dim"], LAYER_CONFIG["linear_value_head_dim"], 2
    batch, time, _ = hidden.shape
    q, k, v, z = layer.in_proj_qkvz(hidden).unflatten(-1, (key_heads, -1)).split(
        [k_dim, k_dim, group * v_dim, group * v_dim], -1)
    b, a = (x.reshape(batch, time, value_heads) for x in
            layer.in_proj_ba(hidden).unflatten(-1, (key_heads, -1)).split([group, group], -1))
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1).transpose(1, 2)
    mixed = causal_conv1d(mixed, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, "silu", cu_seqlens)
    q, k, v = mixed.transpose(1, 2).split([key_heads * k_dim, key_heads * k_dim, value_heads * v_dim], -1)
    q, k = (x.unflatten(-1, (key_heads, k_dim)).repeat_interleave(group, 2) for x in (q, k))
    g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    out, _ = chunk_gated_delta_rule(q, k, v.unflatten(-1, (value_heads, v_dim)), g, b.sigmoid(),
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    normed = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + LAYER_CONFIG["rms_norm_eps"])
    gated = layer.norm.weight * normed * F.silu(z.reshape(batch, time, value_heads, v_dim))
    return layer.out_proj(gated.flatten(2))


def test_a_transformers_layer_is_these_functions_wired_together(hf_layer):
    hidden = torch.randn(2, 70, LAYER_CONFIG["hidden_size"])
    with torch.no_grad():
        torch.testing.assert_close(layer_from_parts(hf_layer, hidden), hf_layer(hidden), atol=ATOL, rtol=0)


def test_a_packed_row_through_the_layer_gives_each_sample_its_own_output(hf_layer):
    samples = [torch.randn(1, length, LAYER_CONFIG["hidden_size"]) for length in (9, 50, 21)]
    row, bounds = pack(samples)
    with torch.no_grad():
        out = layer_from_parts(hf_layer, row, cu_seqlens=bounds)
        for i, sample in enumerate(samples):
            torch.testing.assert_close(out[:, bounds[i]:bounds[i + 1]], hf_layer(sample), atol=ATOL, rtol=0)
