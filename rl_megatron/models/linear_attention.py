"""The linear-attention layers of a hybrid model (Qwen3-Next's and Qwen3.5's Gated DeltaNet) as its config.json
describes them: which layers they are, their sizes, what Megatron's TransformerConfig takes from them, what must hold
for Megatron to compute what transformers does, and their weight-table entries. The Megatron modules:
models/gated_delta_layers.py; the kernels: models/gated_delta.py.

A Gated DeltaNet layer projects each token to queries and keys (key heads), values and an output gate z (value heads,
`values_per_key` sharing each key head), and per value head a write strength b and a decay input a; a short causal
convolution runs over [q | k | v], the delta rule over its output (decay g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b)), then a gated RMSNorm (its own weight times norm(out), times silu(z)) and the output projection.
The two families compute alike and store the input projection differently (`InProjPacking`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rl_megatron.models.weight_layouts import DeltaNetInProj, Entry, HeadSlices, Replicated, Split, SplitSections

# transformers' Qwen3NextConfig (and Qwen3_5TextConfig) defaults, for a config.json that leaves a field out.
SIZE_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32}
FULL_ATTENTION_INTERVAL = 4  # without layer_types, every fourth layer attends fully (transformers' default)
FIELDS = ("layer_types", "full_attention_interval", "hidden_act", *SIZE_DEFAULTS)
LAYER_KINDS = ("linear_attention", "full_attention")
IN_PROJ_PARTS = "qkvzba"  # Megatron's in_proj order


@dataclass(frozen=True)
class InProjPacking:
    """How HF stores the input projection: its tensors (linear_attn.<name>.weight), each holding some of the parts
    q k v z b a, either grouped per key head (all its parts for key head 0, then for key head 1, ...) or one part
    after another, each whole (its heads in order). Value head j belongs to key head j // values_per_key either way."""

    tensors: tuple[tuple[str, str], ...]  # (name, the parts it holds, in order)
    grouped_per_key_head: bool


QWEN3_NEXT_IN_PROJ = InProjPacking((("in_proj_qkvz", "qkvz"), ("in_proj_ba", "ba")), grouped_per_key_head=True)
QWEN3_5_IN_PROJ = InProjPacking((("in_proj_qkv", "qkv"), ("in_proj_z", "z"), ("in_proj_b", "b"), ("in_proj_a", "a")),
                                grouped_per_key_head=False)


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes."""

    key_heads: int
    value_heads: int
    key_dim: int  # per key head (queries and keys)
    value_dim: int  # per value head (values, the gate, the gated norm)
    conv_width: int

    @classmethod
    def of(cls, hf: dict) -> DeltaNetShape:
        size = {key: hf.get(key) or default for key, default in SIZE_DEFAULTS.items()}
        return cls(size["linear_num_key_heads"], size["linear_num_value_heads"], size["linear_key_head_dim"],
                   size["linear_value_head_dim"], size["linear_conv_kernel_dim"])

    @property
    def values_per_key(self) -> int:
        return self.value_heads // self.key_heads

    @property
    def qk(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def v(self) -> int:
        return self.value_heads * self.value_dim

    def per_key_head(self, part: str) -> int:
        """The rows of in_proj `part` (one of IN_PROJ_PARTS) that one key head (and its value heads) has."""
        return {"q": self.key_dim, "k": self.key_dim, "v": self.values_per_key * self.value_dim,
                "z": self.values_per_key * self.value_dim, "b": self.values_per_key, "a": self.values_per_key}[part]


def linear_attention_layers(hf: dict) -> list[bool]:
    """Which layers are Gated DeltaNet layers: those config.json's layer_types marks linear_attention, or without it
    all but every full_attention_interval-th (as transformers reads it). ValueError naming the field otherwise."""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval") or FULL_ATTENTION_INTERVAL
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"full_attention_interval={interval!r} must be a positive integer (every how many "
                             "layers one attends fully).")
        return [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - set(LAYER_KINDS):
        raise ValueError(f"layer_types must name {' or '.join(LAYER_KINDS)} for each of the num_hidden_layers="
                         f"{layers} layers; it has {kinds!r}.")
    return [kind == "linear_attention" for kind in kinds]


def check(hf: dict) -> None:
    """ValueError naming the field where a hybrid config.json asks for what this mapping would compute otherwise than
    transformers does."""
    linear_attention_layers(hf)
    shape = DeltaNetShape.of(hf)
    if shape.value_heads % shape.key_heads:
        raise ValueError(f"linear_num_value_heads={shape.value_heads} must be a multiple of linear_num_key_heads="
                         f"{shape.key_heads} (each key head is shared by as many value heads).")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported (the convolution, the gated norm "
                         "and the MLPs all use it).")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true (biases on q/k/v and on o_proj) is not supported for this family; "
                         "Qwen3-Next's and Qwen3.5's released models leave it false.")
    # transformers' Qwen3NextConfig (and Qwen3.5's) rotates a quarter of each head's dimensions when the field is
    # absent, where every other family here reads an absent field as 1: the config must say it.
    rope = hf.get("rope_parameters") or {}
    if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in rope:
        raise ValueError("partial_rotary_factor is missing; transformers then rotates 0.25 of each head's "
                         "dimensions: write it into config.json (the released Qwen3-Next and Qwen3.5 configs say "
                         "0.25).")


def tp_split_counts(hf: dict) -> dict[str, int]:
    """The linear attention's head counts that tensor parallelism splits, by config.json field."""
    shape = DeltaNetShape.of(hf)
    return {"linear_num_key_heads": shape.key_heads, "linear_num_value_heads": shape.value_heads}


def megatron_fields(hf: dict) -> dict:
    """Megatron TransformerConfig fields of the linear-attention layers (models/gated_delta_layers.py builds them
    where linear_attention_freq says 1)."""
    shape = DeltaNetShape.of(hf)
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[int(linear) for linear in linear_attention_layers(hf)],
                linear_conv_kernel_dim=shape.conv_width, linear_key_head_dim=shape.key_dim,
                linear_value_head_dim=shape.value_dim, linear_num_key_heads=shape.key_heads,
                linear_num_value_heads=shape.value_heads)


def checkpoint_fields(hf: dict) -> dict:
    """What of the linear attention decides a model's tensors (compared when a checkpoint is loaded)."""
    return {"linear_attention_layers": linear_attention_layers(hf), **vars(DeltaNetShape.of(hf))}


def in_proj_entry(hf: dict, packing: InProjPacking) -> Entry:
    """Megatron's in_proj <- HF's input projection tensors, stored as `packing` says."""
    shape, hidden = DeltaNetShape.of(hf), hf["hidden_size"]
    slices, shapes = {}, []
    for tensor, (_, parts) in enumerate(packing.tensors):
        block, offset = sum(shape.per_key_head(part) for part in parts), 0  # a key head's rows of this tensor
        for part in parts:
            width = shape.per_key_head(part)
            # Grouped: within each key head's block; else after the whole parts before it, head after head.
            slices[part] = (HeadSlices(tensor, offset, block, width) if packing.grouped_per_key_head
                            else HeadSlices(tensor, offset * shape.key_heads, width, width))
            offset += width
        shapes.append((shape.key_heads * block, hidden))
    names = tuple(f"model.layers.{{i}}.linear_attn.{name}.weight" for name, _ in packing.tensors)
    return Entry(names, DeltaNetInProj(shape.key_heads, tuple(slices[part] for part in IN_PROJ_PARTS)), tuple(shapes))


def table_entries(hf: dict, packing: InProjPacking) -> dict[str, Entry]:
    """A Gated DeltaNet layer's weight-table entries: Megatron's GatedDeltaNet parameters <- the HF linear_attn
    tensors (the input projection stored as `packing` says)."""
    shape, hidden = DeltaNetShape.of(hf), hf["hidden_size"]
    attn = "model.layers.{i}.linear_attn."
    return {
        "self_attention.in_proj.weight": in_proj_entry(hf, packing),
        # The convolution's channels are [q | k | v], each split over TP.
        "self_attention.conv1d.weight": Entry((attn + "conv1d.weight",), SplitSections((shape.qk, shape.qk, shape.v)),
                                              ((2 * shape.qk + shape.v, 1, shape.conv_width),)),
        "self_attention.A_log": Entry((attn + "A_log",), Split(dim=0), ((shape.value_heads,),)),
        "self_attention.dt_bias": Entry((attn + "dt_bias",), Split(dim=0), ((shape.value_heads,),)),
        "self_attention.out_norm.weight": Entry((attn + "norm.weight",), Replicated(), ((shape.value_dim,),)),
        "self_attention.out_proj.weight": Entry((attn + "out_proj.weight",), Split(dim=1), ((hidden, shape.v),)),
    }
