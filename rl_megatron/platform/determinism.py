"""trainer.deterministic: the same run twice on the same GPUs trains bitwise alike, set up as Megatron-LM's
`--deterministic-mode` and slime's deterministic runs set it up.

- The environment every worker starts with (`deterministic_env`, handed over by `trainer.workers.worker_env` with
  Ray's runtime_env, so that it is there before CUDA, cuBLAS and NCCL start): cuBLAS's fixed workspace
  (CUBLAS_WORKSPACE_CONFIG=:4096:8, which torch requires of deterministic GEMMs), NCCL's ring or tree algorithms only
  (NVLS and CollNet reduce inside the switches, in no fixed order), and Transformer Engine's deterministic kernels
  only (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: its attention leaves out the kernels whose backward is not, e.g.
  FlashAttention 3; Megatron's deterministic_mode refuses TE attention without it).
- Each worker process (`make_process_deterministic`, first thing in the worker): torch's deterministic algorithms
  (scatter/index-add and the flash attention backward take their ordered paths; an op that has none raises, naming
  itself) and cuDNN's deterministic kernels, without benchmarking.
- Megatron's TransformerConfig.deterministic_mode (models/gpt.py): embedding lookups by indexing, whose backward sums
  in order (F.embedding's backward adds with atomics).

Checked at start (`check_environment`, in the config's pre-flight and again in each worker, whose node may have an
environment of its own): a variable above set to a value that cannot be deterministic, or Transformer Engine's
attention narrowed to FlashAttention alone (NVTE_FLASH_ATTN=1 with NVTE_FUSED_ATTN=0 and NVTE_UNFUSED_ATTN=0: the
flash backend Megatron-LM refuses in deterministic mode), is a ConfigError naming trainer.deterministic.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from rl_megatron.errors import ConfigError

KEY = "trainer.deterministic"
# The values each variable may have (the first is what the workers get when it is unset).
ACCEPTED = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),  # torch's two fixed-workspace settings
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
}
NCCL_ALGO, NCCL_DEFAULT = "NCCL_ALGO", "Ring"  # as slime's deterministic runs set it
NCCL_ORDERED = {"ring", "tree"}  # NCCL_ALGO may list these, comma-separated
# Transformer Engine's attention backends, each on unless its variable is "0".
TE_ATTENTION = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise ConfigError naming trainer.deterministic where `environ` holds a setting that cannot be deterministic."""
    for name, accepted in ACCEPTED.items():
        if name in environ and environ[name] not in accepted:
            raise ConfigError(f"{KEY}=true needs {name} in {list(accepted)}, but the environment sets "
                              f"{name}={environ[name]!r}: unset it (the workers then get {accepted[0]}), or set "
                              f"{KEY}=false.")
    algorithms = environ.get(NCCL_ALGO)
    if algorithms is not None and not {a.strip().lower() for a in algorithms.split(",")} <= NCCL_ORDERED:
        raise ConfigError(f"{KEY}=true needs NCCL's ring or tree algorithms, which sum in a fixed order, but the "
                          f"environment sets {NCCL_ALGO}={algorithms!r}: unset it (the workers then get "
                          f"{NCCL_DEFAULT}) or set it to Ring or Tree, or set {KEY}=false.")
    enabled = [name for name in TE_ATTENTION if environ.get(name, "1") != "0"]
    if enabled == ["NVTE_FLASH_ATTN"]:
        raise ConfigError(f"{KEY}=true cannot train with Transformer Engine's FlashAttention alone (the environment "
                          "sets NVTE_FUSED_ATTN=0 and NVTE_UNFUSED_ATTN=0), whose backward is not deterministic "
                          "(Megatron-LM refuses its flash backend in deterministic mode): unset NVTE_FUSED_ATTN and "
                          f"NVTE_UNFUSED_ATTN so that TE picks a deterministic kernel, or set {KEY}=false.")


def deterministic_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every worker gets: `environ`'s own where it sets them (checked), the defaults otherwise."""
    check_environment(environ)
    defaults = {name: accepted[0] for name, accepted in ACCEPTED.items()} | {NCCL_ALGO: NCCL_DEFAULT}
    return {name: environ.get(name, default) for name, default in defaults.items()}


def make_process_deterministic(environ: Mapping[str, str]) -> None:
    """torch's and cuDNN's deterministic settings in this process, whose environment `environ` must hold what
    `deterministic_env` hands the workers (it is read when CUDA, cuBLAS and NCCL start, after this)."""
    check_environment(environ)
    missing = [name for name in deterministic_env(environ) if name not in environ]
    if missing:
        raise ConfigError(f"{KEY}=true: this process started without {', '.join(missing)}, which the workers get "
                          "from the trainer (trainer.workers.worker_env); set them before starting it.")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
