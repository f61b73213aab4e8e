"""How a model chunk holds its activations: Megatron's sequence parallelism (the activations outside the
tensor-parallel regions split over the TP ranks) and activation recomputation (what the forward pass keeps for the
backward pass, and what the backward pass computes again), as one role's config asks for them.

One record per role, built once from the config and passed to the model builder (`models.gpt.build_gpt`), which
turns it into Megatron's TransformerConfig fields (`transformer_config_fields`). The combinations Megatron would
assert on in a worker are refused before anything starts by `rl_megatron.preflight.layout.check_activations`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_megatron import platform
from rl_megatron.config.schema import Config
from rl_megatron.roles import Role

# What selective recomputation recomputes: the attention core (softmax(QK^T) V), Megatron's default and the only
# part of a layer the config offers. Its saved tensors grow with the square of the sequence length (the [b, heads,
# s, s] scores and probabilities of the local attention), the rest of a layer's linearly.
SELECTIVE_MODULES = ("core_attn",)


def sequence_parallel_on(setting: Optional[bool], tp: int, cuda: bool, required: bool) -> bool:
    """actor.sequence_parallel at a TP size: as set; unset, on at TP > 1 with CUDA (Megatron's recommendation: norms,
    residuals and dropout then work on 1/TP of the sequence instead of every TP rank repeating them on all of it, for
    the same bytes over NCCL), and on CPU only where the model `required`s it (`models.family.needs_sequence_parallel`).
    Over gloo each of its all-gathers and reduce-scatters is a round trip of its own, twice TP's all-reduces, to
    split activations a CPU run has no need to split: the demo's step is ~30% faster without (docs/benchmarks.md).
    At TP 1 it is off whatever the key says: one rank has nothing to split (Megatron refuses it there), and a
    reference or critic placed separately at TP 1 follows the actor's key, which may be true for the actor's TP > 1."""
    if tp == 1:
        return False
    return (cuda or required) if setting is None else setting


@dataclass(frozen=True)
class ActivationSettings:
    """The activation keys of one role (its config section's names): None everywhere is Megatron's default at
    the role's TP (sequence parallelism at TP > 1 on GPU, no recomputation)."""
    sequence_parallel: Optional[bool] = None  # None: on at TP > 1 with CUDA or where the model needs it (`sequence_parallel_on`)
    recompute_granularity: Optional[str] = None  # None, "full" (whole layers) or "selective" (SELECTIVE_MODULES)
    recompute_method: Optional[str] = None  # full: "uniform" (groups of recompute_num_layers) or "block"
    recompute_num_layers: Optional[int] = None  # full: layers per group (uniform) or per model chunk (block)
    fused_swiglu: bool = False  # Megatron's SwiGLU in one compiled kernel (bias_activation_fusion), on SwiGLU MLPs
    wgrad_into_main_grad: bool = False  # Megatron's gradient_accumulation_fusion: only where DDP keeps main grads

    @classmethod
    def of_role(cls, cfg: Config, role: Role) -> ActivationSettings:
        """Every role follows actor.sequence_parallel (at its own TP); the roles that train recompute as their
        section says (the critic's keys default to the actor's, `preflight.resolve`). The frozen reference only runs
        forward passes without a graph, where recomputation has nothing to save."""
        sequence_parallel = cfg.actor.sequence_parallel
        fused = platform.on_with_cuda(cfg.actor.fused_swiglu)
        if not role.trainable:
            return cls(sequence_parallel=sequence_parallel, fused_swiglu=fused)
        section = cfg.actor if role is Role.ACTOR else cfg.critic
        wgrad_into_main_grad = platform.on_with_cuda(cfg.actor.gradient_accumulation_fusion)
        return cls(sequence_parallel=sequence_parallel, recompute_granularity=section.recompute_granularity,
                   recompute_method=section.recompute_method, recompute_num_layers=section.recompute_num_layers,
                   fused_swiglu=fused, wgrad_into_main_grad=wgrad_into_main_grad)

    def transformer_config_fields(self, tp: int, swiglu: bool, needs_sequence_parallel: bool) -> dict:
        """Megatron's TransformerConfig fields for these settings at tensor-parallel size `tp` (`swiglu`: the MLPs'
        activation is SwiGLU, which the fusion takes; `needs_sequence_parallel`: the model trains at TP > 1 only
        with it)."""
        fields = dict(sequence_parallel=sequence_parallel_on(self.sequence_parallel, tp, platform.has_cuda(),
                                                             needs_sequence_parallel),
                      recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
                      recompute_num_layers=self.recompute_num_layers,
                      bias_activation_fusion=self.fused_swiglu and swiglu,
                      gradient_accumulation_fusion=self.wgrad_into_main_grad)
        if self.recompute_granularity == "selective":
            fields["recompute_modules"] = list(SELECTIVE_MODULES)
        return fields
