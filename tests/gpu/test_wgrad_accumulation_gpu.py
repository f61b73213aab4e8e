"""One CUDA GPU: the weight gradient of bf16 inputs accumulated by one cuBLAS GEMM into an fp32 main grad
(rl_megatron/platform/wgrad_accumulation.py, Megatron's gradient_accumulation_fusion without Apex): torch's addmm
with out_dtype=float32 must take the call on torch >= 2.8, in place, and its sum must match the fp32 product of the
same bf16 inputs added to the accumulator. Needs torch with CUDA and megatron-core only; seconds.

    pytest tests/gpu/test_wgrad_accumulation_gpu.py -m gpu -v
"""
import pytest
import torch

from rl_megatron.platform import wgrad_accumulation

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def test_bf16_products_accumulate_in_fp32_in_one_gemm():
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert wgrad_accumulation._probe_fp32_out_of_half_inputs(torch.device("cuda")) == (version >= (2, 8))
    if version < (2, 8):
        pytest.skip(f"torch {torch.__version__} has no out_dtype for addmm: the unfused arithmetic runs")
    g = torch.Generator(device="cuda").manual_seed(0)
    total_input = torch.randn(4096, 896, device="cuda", generator=g).bfloat16()
    grad_output = torch.randn(4096, 1152, device="cuda", generator=g).bfloat16()
    main_grad = torch.randn(1152, 896, device="cuda", generator=g)
    expected = main_grad + grad_output.t().float() @ total_input.float()
    storage = main_grad.data_ptr()
    wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == storage and main_grad.dtype == torch.float32
    # fp32 accumulation of exact bf16 products: only the order of the sums differs. A bf16 product rounded before
    # the add would be ~0.1 off at this depth.
    assert torch.allclose(main_grad, expected, rtol=1e-4, atol=1e-3)
