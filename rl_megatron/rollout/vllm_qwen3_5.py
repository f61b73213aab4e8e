"""vLLM's Qwen3.5 text models where torchvision is not installed (the CPU install removes it: a CUDA-linked build
breaks transformers' imports on a CPU torch, docs/architecture.md, "Install").

vLLM keeps Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM in one module with the multimodal models, which imports
transformers' torchvision image processor of Qwen2-VL, for its `smart_resize` alone. Without torchvision, that module
is its PIL twin, which defines the same function (transformers itself falls back to the PIL class for the processor
class), and the folder's architectures are registered as classes: vLLM inspects those in this process, where an
architecture registered by name is inspected in a subprocess that would import the module afresh and fail.
"""
from __future__ import annotations

import importlib.util
import sys

TEXT_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def register_qwen3_5_text_models(architectures: list[str]) -> None:
    """Make the Qwen3.5 text architectures among `architectures` (a config.json's) loadable without torchvision."""
    if not set(architectures) & set(TEXT_ARCHITECTURES) or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models import qwen2_vl
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    sys.modules.setdefault(f"{qwen2_vl.__name__}.image_processing_qwen2_vl", pil)
    qwen2_vl.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # transformers' own fallback, without its warning
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen3_5

    for name in set(architectures) & set(TEXT_ARCHITECTURES):
        ModelRegistry.register_model(name, getattr(qwen3_5, name))
