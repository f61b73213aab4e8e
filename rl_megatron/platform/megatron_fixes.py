"""megatron-core 0.16.1 bugs that every device hits, fixed wherever Megatron runs (those of CPU-only runs are in
`cpu_compat`)."""
from __future__ import annotations

import megatron.core.transformer.moe.moe_utils as moe_utils


def bind_missing_te_general_gemm() -> None:
    """Every router's forward and backward tests `te_general_gemm is not None`, a name moe_utils binds only when
    transformer-engine imports: without TE, a NameError on any device. None (as upstream Megatron-LM binds it since)
    selects the torch GEMM."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    bind_missing_te_general_gemm()
