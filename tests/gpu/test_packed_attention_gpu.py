"""One CUDA GPU: packed attention without Transformer Engine (models/packed_attention.py) through torch's varlen
flash kernel, called with what the installed torch's varlen_attn takes (torch 2.11's has no enable_gqa: key/value
heads are repeated), against SDPA run per sequence, in bf16, for grouped-query and multi-head attention, with and
without a sliding window; the varlen kernel must be the one that ran wherever this torch can take the call. Also:
float32 goes to SDPA (flash kernels take half precision only), and under torch's strict deterministic algorithms
(trainer.deterministic) the varlen backward repeats bit for bit. Needs torch with CUDA and megatron-core only: no Ray,
no vLLM; seconds.

    pytest tests/gpu/test_packed_attention_gpu.py -m gpu -v -rA      (-rA prints varlen_attn's signature)
"""
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import rl_megatron.models.packed_attention as pa

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

BOUNDS = [0, 100, 101, 357, 512, 700]  # uneven spans, one of a single token
HEAD_DIM = 64
SCALE = 0.9 / math.sqrt(HEAD_DIM)  # not the kernels' default: the scale argument must arrive
# bf16 keeps 8 mantissa bits (relative rounding 2^-9): both kernels round their inputs and outputs alike, and the
# norm of their difference stays well inside this bound; a wrong mask, scale or head grouping moves it by O(1).
BF16_RELATIVE = 2e-2


# What this torch's kernel takes (read before any test wraps it).
SIGNATURE = f"torch {torch.__version__}: " + (f"varlen_attn{inspect.signature(pa.varlen_attn)}"
                                              if pa.varlen_attn is not None else "no torch.nn.attention.varlen")


def record_varlen(monkeypatch) -> list[tuple[int, int]]:
    """The (query heads, key heads) of each varlen kernel call from packed attention."""
    calls, kernel = [], pa.varlen_attn

    def recording(query, key, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1]))
        return kernel(query, key, *args, **kwargs)
    if kernel is not None:
        monkeypatch.setattr(pa, "varlen_attn", recording)
    return calls


def inputs(heads: int, groups: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(BOUNDS[-1], h, HEAD_DIM, device="cuda", dtype=dtype, generator=generator).requires_grad_()
            for h in (heads, groups, groups)]


def per_sequence_sdpa(query, key, value, window):
    """Each sequence alone through SDPA with GQA-native sharing: [tokens, heads, d] -> [tokens, 1, heads * d]."""
    outs = []
    for start, end in zip(BOUNDS, BOUNDS[1:]):
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, **pa.causal(end - start, window, q.device), scale=SCALE,
                                             enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1).reshape(end - start, 1, -1))
    return torch.cat(outs)


def forward_backward(fn, tensors, grad):
    out = fn(*tensors)
    out.backward(grad)
    return [out.detach()] + [t.grad.detach().clone() for t in tensors]


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("window", [None, (63, 0)], ids=["causal", "window"])
@pytest.mark.parametrize("heads, groups", [(8, 2), (8, 8)], ids=["gqa", "mha"])
def test_packed_varlen_matches_per_sequence_sdpa_in_bf16(monkeypatch, heads, groups, window):
    print(SIGNATURE)
    calls = record_varlen(monkeypatch)
    packed = pa.packed_seq_params(BOUNDS, torch.device("cuda"))
    plan = pa.varlen_call("cuda", torch.bfloat16, pa.VARLEN_ARGS, window, heads != groups, SCALE)
    print(f"window={window} heads={heads} groups={groups}: {plan}")
    grad = torch.randn(BOUNDS[-1], 1, heads * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    got = forward_backward(lambda q, k, v: pa.packed_attention(q, k, v, packed, SCALE, window),
                           inputs(heads, groups, torch.bfloat16), grad)
    want = forward_backward(lambda q, k, v: per_sequence_sdpa(q, k, v, window),
                            inputs(heads, groups, torch.bfloat16), grad)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        assert relative(a, b) < BF16_RELATIVE, f"{name}: relative difference {relative(a, b):.3g} ({SIGNATURE})"
    if pa.varlen_attn is not None and window is None:
        assert plan is not None, f"this torch has varlen_attn, but packed attention would not call it: {SIGNATURE}"
    # The varlen kernel ran exactly where the plan says, with as many key/value heads as it takes.
    assert calls == ([] if plan is None else [(heads, heads if plan.expand_kv else groups)])


def test_float32_takes_sdpa(monkeypatch):
    calls = record_varlen(monkeypatch)
    packed = pa.packed_seq_params(BOUNDS, torch.device("cuda"))
    with torch.no_grad():
        query, key, value = inputs(8, 2, torch.float32)
        out = pa.packed_attention(query, key, value, packed, SCALE)
        want = per_sequence_sdpa(query, key, value, None)
    assert calls == []
    assert relative(out, want) < 1e-4


def test_varlen_backward_repeats_bitwise_under_strict_determinism(monkeypatch):
    """trainer.deterministic's workers run torch's deterministic algorithms (strict): the varlen kernel stays
    allowed there because its backward then takes FlashAttention's deterministic path. Longer spans than above,
    so that a backward summing in no fixed order would show."""
    calls = record_varlen(monkeypatch)
    bounds = [0, 3000, 3100, 8192]
    packed = pa.packed_seq_params(bounds, torch.device("cuda"))
    torch.use_deterministic_algorithms(True)
    try:
        kernels = pa.allowed_kernels(deterministic=True, strict=pa.strict_determinism())
        runs = []
        for _ in range(3):
            generator = torch.Generator(device="cuda").manual_seed(1)
            tensors = [torch.randn(bounds[-1], h, 128, device="cuda", dtype=torch.bfloat16,
                                   generator=generator).requires_grad_() for h in (16, 4, 4)]
            grad = torch.randn(bounds[-1], 1, 16 * 128, device="cuda", dtype=torch.bfloat16, generator=generator)
            runs.append(forward_backward(lambda q, k, v: pa.packed_attention(q, k, v, packed, SCALE,
                                                                             kernels=kernels), tensors, grad))
    finally:
        torch.use_deterministic_algorithms(False)
    print(SIGNATURE, f"varlen calls: {len(calls)}")
    if pa.varlen_call("cuda", torch.bfloat16, pa.VARLEN_ARGS, None, True, SCALE) is not None:
        assert kernels.varlen and len(calls) == 3
    for run in runs[1:]:
        for name, a, b in zip(("output", "dq", "dk", "dv"), run, runs[0]):
            assert torch.equal(a, b), f"{name} differs between runs under strict determinism ({SIGNATURE})"
