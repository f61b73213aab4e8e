"""megatron-core 0.16.1 bugs that every device hits, fixed wherever Megatron runs (those of CPU-only runs are in
`cpu_compat`)."""
from __future__ import annotations

import megatron.core.transformer.moe.moe_utils as moe_utils
import torch
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
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


def standard_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a new tensor of `shape` (row-major)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def embeddings_in_standard_strides() -> None:
    """The embedding's output, [s, b, h], is its [b, s, h] lookup transposed, and `.contiguous()` keeps a transposed
    tensor whose batch is 1 (a packed row) as it is: `is_contiguous()` ignores the stride of a dimension of size 1.
    The residual stream and every norm's output then carry strides (h, s * h, 1), and `torch.matmul` folds such an
    input into one GEMM only for a weight that requires grad: the policy and a frozen copy of it (the reference)
    rounded the same row apart (one ULP of the log-probs; 3.7e-9 of KL before any update). Under sequence
    parallelism the scatter already makes a new tensor. A copy in row-major strides where they differ, one per
    forward, gives every model the same GEMMs (the policy's results are unchanged)."""
    forward = LanguageModelEmbedding.forward
    if getattr(forward, "in_standard_strides", False):  # applied already (platform.setup may run again)
        return

    def forward_in_standard_strides(self, *args, **kwargs):
        embeddings = forward(self, *args, **kwargs)
        if embeddings.stride() == standard_strides(embeddings.shape):
            return embeddings
        return embeddings.clone(memory_format=torch.contiguous_format)

    forward_in_standard_strides.in_standard_strides = True
    LanguageModelEmbedding.forward = forward_in_standard_strides


def apply() -> None:
    bind_missing_te_general_gemm()
    embeddings_in_standard_strides()
