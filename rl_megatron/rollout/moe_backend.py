"""The fused-MoE kernels of CUDA engines: vLLM's Triton experts, whose weights keep the checkpoint layout.

The weight sync writes the trainer's expert tensors into the engine's parameters in place, in the checkpoint
layout (`rl_megatron.resharding`). vLLM chooses its MoE kernels per layer when the engine starts; where FlashInfer's
rank first (Blackwell, or wherever its kernels are installed and Triton is not preferred) it re-lays each layer's
expert weights after loading into FlashInfer TRT-LLM's block layout, so every later sync would write the wrong
layout. CUDA MoE engines are therefore started with vLLM's `moe_backend="triton"` (an engine argument since vLLM
0.18; a field of its KernelConfig) and checked once started: the engine's kernel config, and every expert layer's
own choice, since vLLM's LoRA engines pick FlashInfer's LoRA experts on Blackwell whatever moe_backend says. NeMo-RL
pins the same backend in its MoE GRPO recipes for the same reason (examples/configs/grpo_math_qwen30ba3b_megatron.yaml:
"vLLM 0.20's default FlashInfer TRTLLM MoE backend isn't refit-compatible"). vLLM's CPU experts keep the parameters
as they are (`rollout/cpu_engine.py`), and Triton's kernels do not run there: CPU engines are left alone.
"""
from __future__ import annotations

import dataclasses
from typing import Collection

from rl_megatron.models.family import moe_experts
from rl_megatron.models.hf_config import read_hf_config

MOE_BACKEND = "triton"
# vLLM's UnquantizedMoeBackend values that read the weights as loaded: Triton's experts, and their batched form, which
# vLLM runs for moe_backend="triton" under a batched activation format (expert parallelism's dispatchers).
TRITON_EXPERTS = ("TRITON", "BATCHED_TRITON")
INSTALL = "install the vLLM that requirements-gpu.txt pins (vllm==0.32.0)"


def pins_moe_backend(model_path: str, cuda: bool) -> bool:
    """Whether an engine of `model_path` on this device is held to Triton's experts: a CUDA engine of an MoE model."""
    return cuda and moe_experts(read_hf_config(model_path)) > 0


def pinned_moe_backend(engine_fields: Collection[str], version: str) -> dict:
    """The EngineArgs fields that start an engine on Triton's experts, given the installed vLLM's EngineArgs fields;
    RuntimeError naming the version where it has no such argument."""
    if "moe_backend" not in engine_fields:
        raise RuntimeError(f"vLLM {version} has no moe_backend engine argument, so an MoE engine cannot be held to "
                           "Triton's expert kernels; the kernels it picks itself may re-lay the expert weights, which "
                           f"the weight sync writes in place in the checkpoint layout. {INSTALL.capitalize()}.")
    return {"moe_backend": MOE_BACKEND}


def engine_moe_arguments(model_path: str, cuda: bool) -> dict:
    """The engine arguments of the MoE kernels of an engine of `model_path`: Triton's on CUDA (`pinned_moe_backend`
    for the vLLM installed), none for a dense model or on CPU. vLLM is imported here: it reads its environment at
    import, which `configure_engine_process` sets first."""
    if not pins_moe_backend(model_path, cuda):
        return {}
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    return pinned_moe_backend({field.name for field in dataclasses.fields(EngineArgs)}, vllm.__version__)


def expert_kernels(model) -> dict[str, str]:
    """The kernels each expert layer of a vLLM model runs (its UnquantizedMoeBackend value), by module name; an
    expert layer built any other way (quantized) shows its method's class."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    kernels = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethodBase):
            backend = getattr(method, "unquantized_backend", None)
            kernels[name] = backend.value if backend is not None else type(method).__name__
    return kernels


def check_moe_kernels(configured: str, kernels: dict[str, str], lora: bool, version: str) -> None:
    """That an engine held to Triton's experts runs them: `configured`, its kernel config's moe_backend; `kernels`,
    each expert layer's (`expert_kernels`); `lora`, whether it serves LoRA adapters. RuntimeError with the fix."""
    if configured != MOE_BACKEND:
        raise RuntimeError(f"The vLLM engine started with moe_backend={configured!r}, not {MOE_BACKEND!r} (vLLM "
                           f"{version}): its expert kernels may re-lay the weights that the weight sync writes in "
                           f"place. {INSTALL.capitalize()}.")
    if not kernels:
        raise RuntimeError(f"The MoE model's vLLM engine has no expert layer that vLLM {version} builds as "
                           "rl_megatron knows (FusedMoEMethodBase quant methods), so its expert kernels cannot be "
                           f"checked. {INSTALL.capitalize()}.")
    other = {name: kernel for name, kernel in kernels.items() if kernel not in TRITON_EXPERTS}
    if not other:
        return
    name, kernel = next(iter(other.items()))
    fix = ("Set actor.lora.merge=true: vLLM's LoRA engines choose their expert kernels whatever moe_backend says, "
           "and with merged adapters the engines serve no LoRA." if lora else
           f"This vLLM did not honour moe_backend={MOE_BACKEND!r}: {INSTALL}.")
    raise RuntimeError(f"{len(other)} of the vLLM engine's {len(kernels)} expert layers run {kernel} kernels "
                       f"({name}, ...) instead of Triton's (vLLM {version}, moe_backend={configured!r}): those re-lay "
                       "the expert weights after loading, and the weight sync writes the trainer's weights in place "
                       f"in the checkpoint layout. {fix}")


def check_engine_moe_kernels(llm, model) -> None:
    """`check_moe_kernels` read back from a started engine: `llm` (a vLLM LLM) and `model`, its model on this rank."""
    import vllm

    config = llm.llm_engine.vllm_config
    check_moe_kernels(config.kernel_config.moe_backend, expert_kernels(model), config.lora_config is not None,
                      vllm.__version__)
