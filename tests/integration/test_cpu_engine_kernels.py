"""The CPU engine's linear layers on vLLM's oneDNN kernel, packed from weight parameters that the syncs write in
place (rl_megatron/rollout/cpu_engine.py): the parameter keeps its storage, a write reaches the very next product,
and an unchanged weight is not packed again; a layer too small for oneDNN to pay is never packed. (That a whole
engine generates as transformers does with the trainer's weights, before and after an update: test_weight_sync.py.)"""
import pytest
import torch

from rl_megatron.rollout.cpu_engine import ONEDNN_MIN_WEIGHTS, keep_cpu_weights_in_place


@pytest.fixture
def packings():
    """The oneDNN handlers packed while the test runs (the arguments of each `create_onednn_mm`)."""
    import vllm._custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN kernels: its CPU linear layers run F.linear on the parameters")
    keep_cpu_weights_in_place()
    made, create = [], ops.create_onednn_mm
    ops.create_onednn_mm = lambda *args: made.append(args) or create(*args)
    yield made
    ops.create_onednn_mm = create


def dispatched(in_features: int, out_features: int) -> torch.nn.Linear:
    from vllm.model_executor.layers import utils

    layer = torch.nn.Linear(in_features, out_features).requires_grad_(False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # as vLLM's linear layers call it
    assert layer.weight.shape == (out_features, in_features)  # kept
    return layer


def test_a_linear_layer_multiplies_by_its_parameter_as_last_written(packings):
    layer = dispatched(512, 384)
    assert layer.weight.numel() >= ONEDNN_MIN_WEIGHTS and len(packings) == 1  # packed once
    x = torch.randn(4, 512)
    for _ in range(2):
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias), expected)
    assert len(packings) == 1  # unchanged: not packed again
    layer.weight[:10].mul_(-3)  # a sync's in-place write, into a region of the parameter
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias),
                               torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert len(packings) == 2


def test_a_small_linear_layer_is_never_packed(packings):
    layer = dispatched(64, 96)
    x = torch.randn(4, 64)
    layer.weight[:10].mul_(-3)
    assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias),
                       torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert packings == []
