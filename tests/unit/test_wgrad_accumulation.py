"""The torch stand-in for Apex's weight-gradient GEMM that Megatron's gradient_accumulation_fusion calls
(rl_megatron/platform/wgrad_accumulation.py): the product accumulated into the main grad, on CPU. The CUDA path
(bf16 inputs, fp32 output) is probed against the same sum where it runs; the actor's update with it is held to DDP's
add in tests/distributed/test_step_levers.py."""
import megatron.core.tensor_parallel.layers as layers
import pytest
import torch

from rl_megatron.platform import wgrad_accumulation

pytestmark = pytest.mark.unit


def operands(dtype):
    g = torch.Generator().manual_seed(0)
    total_input = torch.randn(24, 8, generator=g).to(dtype)  # tokens x in-features
    grad_output = torch.randn(24, 5, generator=g).to(dtype)  # tokens x out-features
    return total_input, grad_output, torch.randn(5, 8, generator=g)


def test_an_fp32_main_grad_gets_the_products_of_fp32_inputs_added():
    total_input, grad_output, main_grad = operands(torch.float32)
    expected = main_grad.clone()
    for _ in range(2):  # micro-batches accumulate
        wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
        expected += grad_output.t() @ total_input
        assert torch.allclose(main_grad, expected, rtol=0, atol=1e-5)

def test_half_inputs_into_an_fp32_main_grad_off_cuda_take_the_unfused_arithmetic():
    total_input, grad_output, main_grad = operands(torch.bfloat16)
    expected = main_grad + (grad_output.t() @ total_input).float()
    wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert torch.equal(main_grad, expected)


def test_a_bf16_main_grad_gets_the_bf16_products_added():
    total_input, grad_output, main_grad = operands(torch.bfloat16)
    main_grad = main_grad.bfloat16()
    expected = torch.addmm(main_grad, grad_output.t(), total_input)
    wgrad_accumulation.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    assert torch.equal(main_grad, expected)


def test_installed_where_apex_is_not():
    wgrad_accumulation.install()
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is not None
