"""Megatron's gradient-accumulation fusion (`TransformerConfig.gradient_accumulation_fusion`) without Apex.

Without it, each linear layer's backward writes its weight gradient in the parameter's dtype (bf16 on GPU), and
DDP's hook then reads it back and adds it into the fp32 main grad: the gradient crosses memory three times, and a
bf16 gradient is rounded before it is accumulated. With it, the weight-gradient GEMM accumulates straight into the
fp32 main grad (cuBLAS's beta = 1), as Megatron-LM's recipes run it with Apex's `fused_weight_gradient_mlp_cuda`.
Megatron refuses the setting where Apex does not import; `install()` gives it this module's two functions, with
Apex's signatures, in its place:

- bf16/fp16 inputs into an fp32 main grad on CUDA: `torch.addmm` with `out_dtype=float32` (torch >= 2.8: cuBLAS's
  half-precision GEMM with fp32 output and accumulation), in place;
- inputs of the main grad's dtype (fp32 CPU runs, bf16 main grads): `addmm_`;
- otherwise (a torch without `out_dtype`) the unfused arithmetic, so the setting never changes what is computed
  beyond rounding.

Where Apex imports, Megatron keeps its kernel; Transformer Engine's layers accumulate by themselves.
"""
from __future__ import annotations

import sys

import megatron.core.tensor_parallel.layers as layers
import torch

_fp32_out_of_half_inputs: bool | None = None  # whether this torch's CUDA addmm takes out_dtype (probed once)


def _probe_fp32_out_of_half_inputs(device: torch.device) -> bool:
    """torch.addmm(out_dtype=float32) on bf16 inputs, in place, gives the fp32 product plus the accumulator."""
    inputs = torch.arange(6, device=device, dtype=torch.bfloat16).reshape(3, 2)
    accumulator = torch.ones(2, 2, device=device)
    expected = accumulator + inputs.t().float() @ inputs.float()
    try:
        torch.addmm(accumulator, inputs.t(), inputs, out_dtype=torch.float32, out=accumulator)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(accumulator, expected))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output^T @ total_input, both 2-D (tokens x features), as Apex's kernel of this name."""
    global _fp32_out_of_half_inputs
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    if main_grad.is_cuda:
        if _fp32_out_of_half_inputs is None:
            _fp32_out_of_half_inputs = _probe_fp32_out_of_half_inputs(main_grad.device)
        if _fp32_out_of_half_inputs:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
            return
    main_grad.add_(grad_output.t().mm(total_input))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (bf16/fp16, the inputs' dtype) += grad_output^T @ total_input."""
    main_grad.addmm_(grad_output.t(), total_input)


def install() -> None:
    """Make Megatron's gradient_accumulation_fusion available where Apex's kernel is not (idempotent). Inert until
    a TransformerConfig asks for it (`actor.gradient_accumulation_fusion`)."""
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        layers._grad_accum_fusion_available = True
