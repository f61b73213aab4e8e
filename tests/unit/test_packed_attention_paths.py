"""Which kernel packed attention runs (models/packed_attention.py), decided per call: torch's varlen flash kernel on
CUDA in half precision with the arguments the installed torch's signature takes (2.11's has no enable_gqa: key/value
heads are repeated instead), SDPA otherwise; under trainer.deterministic only kernels with a deterministic backward.
The CUDA kernels themselves run in tests/gpu/test_packed_attention_gpu.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import rl_megatron.models.packed_attention as pa
from rl_megatron.models.packed_attention import (Kernels, PackedDotProductAttention, VarlenCall, allowed_kernels,
                                                 packed_attention, packed_seq_params, run_varlen, varlen_call)

# The parameters of varlen_attn's releases, as each takes them by keyword.
TORCH_2_13 = frozenset({"return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table",
                        "num_splits"})
TORCH_2_11 = TORCH_2_13 - {"enable_gqa"}
TORCH_2_9 = frozenset({"is_causal", "return_aux"})  # no scale: Megatron's is always passed
CAUSAL_ONLY = frozenset({"is_causal", "scale"})  # causality by flag, no window_size
SCALE = 0.125
CPU = torch.device("cpu")


def call(takes=TORCH_2_13, device="cuda", dtype=torch.bfloat16, window=None, gqa=True, allowed=True):
    return varlen_call(device, dtype, takes, window, gqa, SCALE, allowed)


def test_varlen_takes_half_precision_cuda_calls_with_what_the_signature_has():
    assert call() == VarlenCall({"window_size": (-1, 0), "scale": SCALE, "enable_gqa": True})
    assert call(dtype=torch.float16, gqa=False) == VarlenCall({"window_size": (-1, 0), "scale": SCALE,
                                                                 "enable_gqa": False})
    # torch 2.11: no enable_gqa, so grouped key/value heads are repeated up to the query's; MHA needs nothing.
    assert call(TORCH_2_11) == VarlenCall({"window_size": (-1, 0), "scale": SCALE}, expand_kv=True)
    assert call(TORCH_2_11, gqa=False) == VarlenCall({"window_size": (-1, 0), "scale": SCALE}, expand_kv=False)
    # A sliding window (before, 0) where window_size exists; causality by flag where only is_causal does.
    assert call(TORCH_2_11, window=(3, 0)).kwargs["window_size"] == (3, 0)
    assert call(CAUSAL_ONLY, gqa=False) == VarlenCall({"is_causal": True, "scale": SCALE})


@pytest.mark.parametrize("case", [
    dict(dtype=torch.float32),  # flash kernels take fp16/bf16 only: torch 2.13 raised on float32 models here
    dict(device="cpu"),
    dict(takes=frozenset()),  # no varlen_attn in this torch
    dict(takes=TORCH_2_9),  # no scale argument
    dict(takes=CAUSAL_ONLY, window=(3, 0)),  # a window the kernel cannot take
    dict(allowed=False),  # trainer.deterministic without torch's strict deterministic algorithms
], ids=["float32", "cpu", "no-varlen", "no-scale", "window-unsupported", "not-allowed"])
def test_sdpa_takes_what_the_varlen_kernel_cannot(case):
    assert call(**case) is None


def test_the_installed_torch_runs_varlen_on_cuda_in_bf16_where_it_has_the_kernel():
    """The old check demanded both window_size and enable_gqa, so a torch without enable_gqa never took it."""
    expected = pa.varlen_attn is not None and "scale" in pa.VARLEN_ARGS and (
        "window_size" in pa.VARLEN_ARGS or "is_causal" in pa.VARLEN_ARGS)
    assert (call(pa.VARLEN_ARGS) is not None) == expected
    assert call(pa.VARLEN_ARGS, dtype=torch.float32) is None


def test_deterministic_runs_only_kernels_with_an_ordered_backward():
    assert allowed_kernels(deterministic=False, strict=False) == Kernels(varlen=True, sdpa=None)
    assert allowed_kernels(deterministic=False, strict=True) == Kernels(varlen=True, sdpa=None)
    strict = allowed_kernels(deterministic=True, strict=True)
    assert strict.varlen and set(strict.sdpa) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                  SDPBackend.MATH}
    assert allowed_kernels(deterministic=True, strict=False) == Kernels(varlen=False, sdpa=(SDPBackend.MATH,))


def spans_reference(query, key, value, bounds, window=None, scale=SCALE):
    """Per-span SDPA with GQA-native key/value sharing: [tokens, heads, d] in, [tokens, heads * d] out."""
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, **pa.causal(end - start, window, q.device), scale=scale,
                                             enable_gqa=q.shape[0] != k.shape[0])
        outs.append(out.transpose(0, 1).reshape(end - start, -1))
    return torch.cat(outs)


def qkv(tokens=13, heads=4, groups=2, d=8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, h, d, generator=generator, dtype=dtype) for h in (heads, groups, groups)]


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.11's varlen_attn as a CPU stand-in: no enable_gqa, so key/value must have the query's heads."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "a kernel without enable_gqa wants equal head counts"
    assert window_size[1] == 0
    window = None if window_size[0] == -1 else (window_size[0], 0)
    return spans_reference(query, key, value, cu_seq_q.tolist(), window, scale).view_as(query)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_repeated_key_value_heads_equal_gqa_native_attention(monkeypatch, window):
    monkeypatch.setattr(pa, "varlen_attn", varlen_2_11)
    query, key, value = qkv()
    bounds = [0, 5, 6, 13]
    plan = varlen_call("cuda", torch.bfloat16, TORCH_2_11, window, gqa=True, scale=SCALE)
    assert plan.expand_kv
    out = run_varlen(query, key, value, packed_seq_params(bounds, CPU), plan)
    assert out.shape == (13, 1, 4 * 8)
    torch.testing.assert_close(out.squeeze(1), spans_reference(query, key, value, bounds, window), atol=1e-6,
                               rtol=0)


def layer(deterministic: bool, window=None):
    """What PackedDotProductAttention.forward reads of its layer, without Megatron's parallel state."""
    return SimpleNamespace(config=SimpleNamespace(deterministic_mode=deterministic), window=window,
                           softmax_offset=None, softmax_scale=SCALE)


def backends_seen(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """The (flash, memory-efficient, cuDNN, math) SDPA backends enabled at each SDPA call."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        cuda = torch.backends.cuda
        seen.append((cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
                     cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


@pytest.fixture
def strict_determinism():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_forward_on_cpu_matches_per_span_attention(monkeypatch, deterministic):
    query, key, value = qkv()
    bounds = [0, 4, 8, 13]  # two spans of one length: one SDPA call for both
    expected = spans_reference(query, key, value, bounds)
    seen = backends_seen(monkeypatch)
    out = PackedDotProductAttention.forward(layer(deterministic), query, key, value, None,
                                            packed_seq_params=packed_seq_params(bounds, CPU))
    torch.testing.assert_close(out.squeeze(1), expected, atol=1e-6, rtol=0)
    # trainer.deterministic without torch's strict deterministic algorithms: the math backend alone.
    assert seen == ([(True, True, True, True)] * 2 if not deterministic else [(False, False, False, True)] * 2)
    assert torch.backends.cuda.flash_sdp_enabled()  # the pin ends with the call


def test_deterministic_under_strict_algorithms_keeps_the_fused_backends(monkeypatch, strict_determinism):
    seen = backends_seen(monkeypatch)
    query, key, value = qkv()
    packed = packed_seq_params([0, 6, 13], CPU)
    for deterministic in (True, False):
        PackedDotProductAttention.forward(layer(deterministic), query, key, value, None, packed_seq_params=packed)
    # Flash's and the memory-efficient backward take their ordered paths there; cuDNN's has none.
    assert seen == [(True, True, False, True)] * 2 + [(True, True, True, True)] * 2
