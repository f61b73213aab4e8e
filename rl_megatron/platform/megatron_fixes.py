"""megatron-core 0.16.1 bugs that every device hits, fixed wherever Megatron runs (those of CPU-only runs are in
`cpu_compat`)."""
from __future__ import annotations

import megatron.core.transformer.moe.moe_utils as moe_utils
import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.utils import get_pg_size


def bind_missing_te_general_gemm() -> None:
    """Every router's forward and backward tests `te_general_gemm is not None`, a name moe_utils binds only when
    transformer-engine imports: without TE, a NameError on any device. None (as upstream Megatron-LM binds it since)
    selects the torch GEMM."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def fix_expert_biases(model: torch.nn.Module) -> None:
    """Two bugs of experts with output biases (gpt-oss), in their down projections:

    - Megatron marks that bias `sequence_parallel` like a dense layer's, so under sequence parallelism its gradient
      is summed over the TP group, as if each rank had seen a part of the tokens. An expert sees every token routed
      to it (the dispatcher gathers them), and the TP ranks may hold other experts: the sum mixes experts.
    - The MLP adds the bias in place into the projection's output. Without expert parallelism at expert-TP 1, that
      output comes out of a TP all-reduce over one rank, which returns its input as a view, and autograd refuses the
      in-place add when training. Over one rank the all-reduce is nothing: it is skipped, as under expert
      parallelism."""
    for module in model.modules():
        if isinstance(module, RowParallelLinear) and module.is_expert:
            if module.bias is not None:
                module.bias.sequence_parallel = False
            if get_pg_size(module.tp_group) == 1:
                module.explicit_expert_comm = True


def apply() -> None:
    bind_missing_te_general_gemm()
