"""vLLM's CPU attention against the model's head size, where the rollout engines run without CUDA.

vLLM's CPU platform picks its attention backend without checking the head size: CPU_ATTN for ordinary attention,
CPU_MLA for DeepSeek's latent attention (the engines ask for it, `rollout.vllm_engine.engine_arguments`). Their
kernels are compiled for a fixed list of head sizes, and any other fails inside the worker at the first forward
(`Unsupported CPU attention configuration: head_dim=...`). The lists below are the backends' own
(`get_supported_head_sizes`); tests/unit/test_vllm_cpu_attention.py reads them from the installed vLLM's source to keep
them in step (importing vLLM here would cost every pre-flight check seconds). The dtypes those backends take
(float16, bfloat16, float32) cover every model.dtype choice, which the same test checks.
"""
from __future__ import annotations

from rl_megatron.errors import ConfigError
from rl_megatron.models.checks import MODEL_SOURCE
from rl_megatron.models.family import family_of

# vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes (vLLM 0.32).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm/v1/attention/backends/mla/cpu_mla.py, CPUMLABackend.get_supported_head_sizes: the latent cache's width,
# kv_lora_rank + qk_rope_head_dim (DeepSeek-V2/V3's 512 + 64).
CPU_MLA_HEAD_SIZES = (576,)


def engine_head_size(hf: dict) -> tuple[int, str]:
    """The head size vLLM's attention backend gets for config.json `hf` (vLLM's `get_head_size`), and the fields it
    comes from, as text for messages."""
    if family_of(hf).mla:
        size = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
        return size, f"kv_lora_rank={hf['kv_lora_rank']} + qk_rope_head_dim={hf['qk_rope_head_dim']} = {size}"
    if hf.get("head_dim"):
        return hf["head_dim"], f"head_dim={hf['head_dim']}"
    size = hf["hidden_size"] // hf["num_attention_heads"]
    return size, f"hidden_size={hf['hidden_size']} / num_attention_heads={hf['num_attention_heads']} = {size}"


def check_cpu_attention(hf: dict, cuda: bool, source: str = MODEL_SOURCE) -> None:
    """Where the engines run without CUDA, the model's head size is one vLLM's CPU attention is compiled for;
    ConfigError naming the config.json field and the sizes that work (`VLLMEngine.check_model`)."""
    if cuda:
        return
    size, fields = engine_head_size(hf)
    mla = family_of(hf).mla
    supported = CPU_MLA_HEAD_SIZES if mla else CPU_ATTENTION_HEAD_SIZES
    if size in supported:
        return
    backend = "CPU_MLA (latent attention)" if mla else "CPU_ATTN"
    sizes = ", ".join(map(str, supported))
    fix = ("kv_lora_rank + qk_rope_head_dim must be 576 (e.g. 512 + 64, as DeepSeek-V2/V3)" if mla else
           f"set head_dim (or hidden_size / num_attention_heads) to one of {sizes}")
    raise ConfigError(f"{source} has {fields}, but without CUDA the rollout engines run vLLM's {backend} attention, "
                      f"whose kernels take head sizes {sizes} only: the engine would fail at its first step "
                      f"(\"Unsupported CPU attention configuration\"). Use a model whose {fix}, or run on CUDA "
                      "GPUs.")
