"""gpt-oss's weight table, and its experts as its checkpoints store them.

Everything that moves weights here (loading, the sync into vLLM, export) speaks one name per tensor of one expert,
laid out as `nn.Linear` holds it: `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [width, hidden], `up_proj`,
`down_proj` [hidden, width], and their biases. gpt-oss's checkpoints (and transformers' model) instead stack a
layer's experts into one tensor per projection, input-major, with gate and up interleaved along the output:

    experts.gate_up_proj       [experts, hidden, 2 * width]   gate = [..., 0::2], up = [..., 1::2]
    experts.gate_up_proj_bias  [experts, 2 * width]           likewise
    experts.down_proj          [experts, width, hidden]
    experts.down_proj_bias     [experts, hidden]

`StackedExpertsTable` converts at the folder's edge only: a per-expert tensor read from the stacked one, and the
per-expert tensors stacked again for writing. Beyond the experts, gpt-oss adds biases to the attention output and
the router (named `router`, not `gate`), and a learned sink logit per attention head (`self_attn.sinks`).
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from rl_megatron.models.weight_layouts import Entry, FusedGateUp, Replicated, Shape, Split
from rl_megatron.models.weight_tables import MoeTable

# A per-expert name: (layer prefix, expert, projection, weight or bias).
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
# Stacked tensor of each (projection, weight or bias), and which half of the interleaved output it holds.
_STORED = {("gate_proj", "weight"): ("gate_up_proj", 0), ("up_proj", "weight"): ("gate_up_proj", 1),
           ("gate_proj", "bias"): ("gate_up_proj_bias", 0), ("up_proj", "bias"): ("gate_up_proj_bias", 1),
           ("down_proj", "weight"): ("down_proj", None), ("down_proj", "bias"): ("down_proj_bias", None)}


def stored_part(name: str) -> tuple[str, int, int | None, bool] | None:
    """(stored tensor name, expert, interleaved half or None, is a weight) of a per-expert name; None otherwise."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, projection, kind = match.groups()
    stored, half = _STORED[(projection, kind)]
    return f"{prefix}.{stored}", int(expert), half, kind == "weight"


def per_expert(tensor: torch.Tensor, half: int | None, weight: bool) -> torch.Tensor:
    """One expert's tensor, as nn.Linear holds it, out of its slice of a stacked one (a view: the loader copies it
    into its shard)."""
    if half is not None:
        tensor = tensor[..., half::2]
    return tensor.t() if weight else tensor


class StackedExpertsTable(MoeTable):
    """MoeTable with gpt-oss's router name, biases on every linear layer and attention sinks, whose folders store
    the experts stacked (module docstring)."""

    def __init__(self, hf_config: dict, padded_vocab: int, names, experts: int, expert_width: int, qkv_bias: bool,
                 qk_layernorm: bool, **moe):
        super().__init__(hf_config, padded_vocab, names, experts, expert_width, qkv_bias, qk_layernorm, **moe)
        hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        attn, block = "model.layers.{i}.self_attn.", f"model.layers.{{i}}.{names.block}."
        expert = block + "experts.{e}."
        self.layer.update({
            "self_attention.linear_proj.bias": Entry((attn + "o_proj.bias",), Replicated(), ((hidden,),)),
            # One sink logit per query head: split over TP with the heads.
            "self_attention.core_attention.softmax_offset": Entry((attn + "sinks",), Split(dim=0), ((heads,),)),
            "mlp.router.weight": Entry((block + "router.weight",), Replicated(), ((experts, hidden),)),
            "mlp.router.bias": Entry((block + "router.bias",), Replicated(), ((experts,),)),
            "mlp.experts.linear_fc1.bias": Entry((expert + names.gate + ".bias", expert + names.up + ".bias"),
                                                 FusedGateUp(), ((expert_width,), (expert_width,))),
            "mlp.experts.linear_fc2.bias": Entry((expert + names.down + ".bias",), Replicated(), ((hidden,),)),
        })

    def stored_shapes(self, needed: dict[str, Shape]) -> dict[str, Shape]:
        """The tensors a folder stores for the per-expert `needed` (name -> shape), with their shapes."""
        stored = {}
        for name, shape in needed.items():
            part = stored_part(name)
            if part is None:
                stored[name] = shape
                continue
            stacked, _, half, weight = part
            one = shape[::-1] if weight else shape  # one expert's, input-major
            if half is not None:  # gate and up side by side
                one = (*one[:-1], 2 * one[-1])
            stored[stacked] = (self.experts, *one)
        return stored

    def stored_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole per-expert state dict as the folder stores it (the experts stacked, in expert order)."""
        out, stacks = {}, {}
        for name, tensor in state.items():
            part = stored_part(name)
            if part is None:
                out[name] = tensor
                continue
            stacked, expert, half, weight = part
            stacks.setdefault(stacked, {})[(expert, half)] = tensor.t() if weight else tensor

        def stored_expert(parts: dict, expert: int) -> torch.Tensor:
            if (expert, None) in parts:
                return parts[(expert, None)]
            return torch.stack([parts[(expert, 0)], parts[(expert, 1)]], -1).flatten(-2)  # gate, up interleaved

        for stacked, parts in stacks.items():
            out[stacked] = torch.stack([stored_expert(parts, e) for e in range(self.experts)]).contiguous()
        return out

    def stored_reader(self, get: Callable[..., torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """`get` (stored name, optionally an expert -> the tensor, or only that expert's slice of it) as a per-expert
        name -> tensor reader. Each expert's slice of a stack is read alone (a rank loads only its own experts) and
        kept while its four tensors are read."""
        cache: dict[str, tuple[int, torch.Tensor]] = {}

        def read(name: str) -> torch.Tensor:
            part = stored_part(name)
            if part is None:
                return get(name)
            stacked, expert, half, weight = part
            if cache.get(stacked, (None,))[0] != expert:
                cache[stacked] = (expert, get(stacked, expert))
            return per_expert(cache[stacked][1], half, weight)

        return read
