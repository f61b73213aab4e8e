"""CUDA MoE engines held to vLLM's Triton experts (rollout/moe_backend.py): the engine argument that pins them, where
it is given, the refusal where the installed vLLM cannot take it, and the check of a started engine's kernels, read
back from vLLM's own classes (a CPU machine cannot start a CUDA engine)."""
from types import SimpleNamespace

import pytest
import torch

from rl_megatron.config.schema import RolloutConfig
from rl_megatron.rollout.moe_backend import (MOE_BACKEND, TRITON_EXPERTS, check_engine_moe_kernels,
                                             check_moe_kernels, expert_kernels, pinned_moe_backend)
from rl_megatron.rollout.vllm_engine import engine_arguments

MOE, DENSE = "configs/models/tiny-qwen3-moe-digits", "configs/models/tiny-qwen2-digits"


def arguments(model_path: str, cuda: bool) -> dict:
    return engine_arguments(model_path, RolloutConfig(max_model_len=64), "bfloat16", 0, None, "dummy", cuda=cuda,
                            mla=False, group_timeout_s=None)


def test_cuda_moe_engines_and_only_they_start_on_triton_experts():
    from vllm.engine.arg_utils import EngineArgs

    assert arguments(MOE, cuda=True)["moe_backend"] == MOE_BACKEND
    assert EngineArgs(**arguments(MOE, cuda=True)).moe_backend == "triton"
    assert "moe_backend" not in arguments(DENSE, cuda=True)
    assert "moe_backend" not in arguments(MOE, cuda=False)  # vLLM's CPU experts; Triton's do not run there


def test_triton_is_a_backend_the_installed_vllm_maps_to_its_triton_experts():
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import map_unquantized_backend

    assert KernelConfig(moe_backend=MOE_BACKEND).moe_backend == MOE_BACKEND
    assert map_unquantized_backend(MOE_BACKEND).value in TRITON_EXPERTS


def test_a_vllm_without_the_engine_argument_is_refused_naming_its_version():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.17\.1 has no moe_backend engine argument.*vllm==0\.32\.0"):
        pinned_moe_backend({"model", "dtype"}, "0.17.1")


def moe_model(*backends):
    """A module tree whose expert layers hold vLLM's unquantized MoE method with these kernel choices."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    model = torch.nn.Module()
    for i, backend in enumerate(backends):
        experts = torch.nn.Module()
        method = object.__new__(UnquantizedFusedMoEMethod)  # its kernel choice is all that is read
        torch.nn.Module.__init__(method)  # (a vLLM CustomOp is a module)
        method.unquantized_backend = UnquantizedMoeBackend[backend]
        experts.quant_method = method
        model.add_module(f"layer{i}", experts)
    model.add_module("dense", torch.nn.Linear(2, 2))  # no quant_method: not an expert layer
    return model


def test_each_expert_layers_kernels_are_read_from_vllms_method():
    assert expert_kernels(moe_model("TRITON", "FLASHINFER_TRTLLM")) == {"layer0": "TRITON",
                                                                        "layer1": "FlashInfer TRTLLM"}


def test_an_engine_on_triton_experts_passes():
    check_moe_kernels("triton", expert_kernels(moe_model("TRITON", "BATCHED_TRITON")), lora=False, version="0.32.0")
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        kernel_config=SimpleNamespace(moe_backend="triton"), lora_config=None)))
    check_engine_moe_kernels(llm, moe_model("TRITON"))


@pytest.mark.parametrize("lora, fix", [(True, "Set actor.lora.merge=true"), (False, "did not honour moe_backend")])
def test_an_engine_on_flashinfer_experts_is_refused_with_the_fix(lora, fix):
    """vLLM's LoRA engines choose FlashInfer's LoRA experts on Blackwell whatever moe_backend says."""
    kernels = expert_kernels(moe_model("TRITON", "FLASHINFER_TRTLLM", "FLASHINFER_TRTLLM"))
    with pytest.raises(RuntimeError, match=rf"2 of the vLLM engine's 3 expert layers run FlashInfer TRTLLM kernels "
                                           rf"\(layer1, \.\.\.\).*in place.*{fix}"):
        check_moe_kernels("triton", kernels, lora=lora, version="0.32.0")


def test_an_engine_not_configured_for_triton_or_without_known_expert_layers_is_refused():
    with pytest.raises(RuntimeError, match="started with moe_backend='auto', not 'triton'"):
        check_moe_kernels("auto", {"layer0": "TRITON"}, lora=False, version="0.32.0")
    with pytest.raises(RuntimeError, match=r"no expert layer that vLLM 0\.33\.0 builds as rl_megatron knows"):
        check_moe_kernels("triton", {}, lora=False, version="0.33.0")
