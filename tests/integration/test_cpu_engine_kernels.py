"""The CPU engine's linear layers on vLLM's oneDNN kernel, packed from weight parameters that the syncs write in
place (rl_megatron/rollout/cpu_engine.py): the parameter keeps its storage, a write reaches the very next product,
and an unchanged weight is not packed again. (That a whole engine generates as transformers does with the trainer's
weights, before and after an update: test_weight_sync.py.)"""
import pytest
import torch

from rl_megatron.rollout.cpu_engine import keep_cpu_weights_in_place


def test_a_linear_layer_multiplies_by_its_parameter_as_last_written():
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN kernels: its CPU linear layers run F.linear on the parameters")
    keep_cpu_weights_in_place()
    packings, create = [], ops.create_onednn_mm
    ops.create_onednn_mm = lambda *args: packings.append(args) or create(*args)
    try:
        layer = torch.nn.Linear(64, 96).requires_grad_(False)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # as vLLM's linear layers call it
        assert layer.weight.shape == (96, 64) and len(packings) == 1  # kept, packed once
        x = torch.randn(4, 64)
        for _ in range(2):
            expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias), expected)
        assert len(packings) == 1  # unchanged: not packed again
        layer.weight[:10].mul_(-3)  # a sync's in-place write, into a region of the parameter
        torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias),
                                   torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert len(packings) == 2
    finally:
        ops.create_onednn_mm = create
