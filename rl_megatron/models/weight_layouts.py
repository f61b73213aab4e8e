"""How one tensor-parallel shard of a Megatron parameter holds its Hugging Face tensor(s), as regions: the machinery of
the weight tables (`weight_tables.py`).

A `Layout` says which parts of the HF tensor(s) one tensor-parallel shard of a Megatron parameter holds, and
where: a list of `Region`s. Everything that moves weights (HF -> shards at load, shards -> vLLM at every
sync, shards -> HF files) copies regions; no code path has its own notion of a fused layout. An `Entry` is one
line of a table: a Megatron parameter's HF name(s), their shapes and its layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """HF tensor `hf_name` (full shape `hf_shape`), box `start..stop` (per dim), is held by a local tensor at
    `local[index][origin .. origin + (stop - start)]`, every `step`-th element along each dim (empty: every one;
    vLLM's gpt-oss experts interleave gate and up rows). `index` selects a sub-tensor first (one expert of a tensor
    that stacks experts)."""

    hf_name: str
    hf_shape: Shape
    start: Shape
    stop: Shape
    origin: Shape
    index: tuple[int, ...] = ()
    step: Shape = ()

    @property
    def steps(self) -> Shape:
        return self.step or (1,) * len(self.start)


def along(hf_name: str, hf_shape: Shape, dim: int, start: int, stop: int, at: int, index=(), every: int = 1) -> Region:
    """Rows start..stop of `hf_shape` along `dim` (everything along the other dims), at `at` in the local tensor
    (and every `every`-th row from there)."""
    begin = [0] * len(hf_shape)
    end = list(hf_shape)
    origin = [0] * len(hf_shape)
    step = [1] * len(hf_shape)
    begin[dim], end[dim], origin[dim], step[dim] = start, stop, at, every
    return Region(hf_name, tuple(hf_shape), tuple(begin), tuple(end), tuple(origin), tuple(index),
                  tuple(step) if every != 1 else ())


def whole(hf_name: str, hf_shape: Shape) -> Region:
    return along(hf_name, hf_shape, 0, 0, hf_shape[0], 0)


def local_view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of a local tensor that holds `region`."""
    t = tensor[region.index] if region.index else tensor
    return t[tuple(slice(o, o + (b - a - 1) * k + 1, k)
                   for o, a, b, k in zip(region.origin, region.start, region.stop, region.steps))]


def hf_view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of the full HF tensor that `region` covers."""
    return tensor[tuple(slice(a, b) for a, b in zip(region.start, region.stop))]


class Layout:
    """Which parts of the HF tensors (shapes `hf_shapes`, in the entry's name order) TP rank `rank` of `size` holds."""

    def local_shape(self, hf_shapes: list[Shape], size: int) -> Shape:
        raise NotImplementedError

    def regions(self, hf_names: list[str], hf_shapes: list[Shape], rank: int, size: int) -> list[Region]:
        raise NotImplementedError


class Replicated(Layout):
    """Same tensor on every TP rank (norms)."""

    def local_shape(self, hf_shapes, size):
        return hf_shapes[0]

    def regions(self, hf_names, hf_shapes, rank, size):
        return [whole(hf_names[0], hf_shapes[0])]


@dataclass
class Split(Layout):
    """Split along `dim` (dim 0: column-parallel, dim 1: row-parallel)."""

    dim: int

    def local_shape(self, hf_shapes, size):
        shape = list(hf_shapes[0])
        shape[self.dim] //= size
        return tuple(shape)

    def regions(self, hf_names, hf_shapes, rank, size):
        n = hf_shapes[0][self.dim] // size
        return [along(hf_names[0], hf_shapes[0], self.dim, rank * n, (rank + 1) * n, 0)]


@dataclass
class PaddedVocab(Layout):
    """Embedding / output rows: Megatron pads the vocabulary to `padded` rows; the padding belongs to no HF row."""

    padded: int

    def local_shape(self, hf_shapes, size):
        return (self.padded // size, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        per, vocab = self.padded // size, hf_shapes[0][0]
        start, stop = rank * per, min((rank + 1) * per, vocab)
        return [along(hf_names[0], hf_shapes[0], 0, start, stop, 0)] if start < stop else []


@dataclass
class FusedQKV(Layout):
    """Megatron's linear_qkv holds, per query group, [the group's q heads, its k head, its v head]; TP splits
    whole groups. HF keeps q, k and v apart. Works for weights ([out, in]) and biases ([out]). `gated`: HF's q
    projection holds each head's query then its output gate (Qwen3-Next), which Megatron's linear_qkv (with
    attention_output_gate) keeps per group as [the group's q heads, their gates, k head, v head]."""

    groups: int
    heads: int
    head_dim: int
    gated: bool = False

    def local_shape(self, hf_shapes, size):
        query_heads = self.heads * (2 if self.gated else 1)
        rows = (query_heads + 2 * self.groups) * self.head_dim // size
        return (rows, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        per_group, d = self.heads // self.groups, self.head_dim
        q_rows = per_group * d * (2 if self.gated else 1)  # the group's queries (and gates) in linear_qkv
        per_rank = self.groups // size
        out = []
        for j in range(per_rank):
            group, base = rank * per_rank + j, j * (q_rows + 2 * d)
            if self.gated:  # HF: head h's query at rows 2hd..2hd+d, its gate right after
                for h in range(per_group):
                    head = group * per_group + h
                    out += [along(hf_names[0], hf_shapes[0], 0, 2 * head * d, 2 * head * d + d, base + h * d),
                            along(hf_names[0], hf_shapes[0], 0, 2 * head * d + d, 2 * head * d + 2 * d,
                                  base + (per_group + h) * d)]
            else:
                out.append(along(hf_names[0], hf_shapes[0], 0, group * q_rows, (group + 1) * q_rows, base))
            out += [along(hf_names[1], hf_shapes[1], 0, group * d, (group + 1) * d, base + q_rows),
                    along(hf_names[2], hf_shapes[2], 0, group * d, (group + 1) * d, base + q_rows + d)]
        return out


class FusedGateUp(Layout):
    """Megatron's linear_fc1 of a gated MLP holds [gate shard; up shard] on each TP rank."""

    def local_shape(self, hf_shapes, size):
        return (2 * hf_shapes[0][0] // size, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        n = hf_shapes[0][0] // size
        return [along(hf_names[0], hf_shapes[0], 0, rank * n, (rank + 1) * n, 0),
                along(hf_names[1], hf_shapes[1], 0, rank * n, (rank + 1) * n, n)]


@dataclass
class SplitSections(Layout):
    """One HF tensor made of `sections` (row counts along dim 0, one after another), each split over TP: a rank
    holds its share of each, in order (Megatron's GatedDeltaNet conv1d: the [q | k | v] channels)."""

    sections: tuple[int, ...]

    def local_shape(self, hf_shapes, size):
        return (hf_shapes[0][0] // size, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        out, start, at = [], 0, 0
        for rows in self.sections:
            share = rows // size
            out.append(along(hf_names[0], hf_shapes[0], 0, start + rank * share, start + (rank + 1) * share, at))
            start, at = start + rows, at + share
        return out


@dataclass(frozen=True)
class HeadSlices:
    """Where HF keeps one part of a Gated DeltaNet input projection: key head h's slice is rows
    `start + h * stride` .. `+ width` of the entry's HF tensor number `tensor`."""

    tensor: int
    start: int
    stride: int
    width: int


@dataclass
class DeltaNetInProj(Layout):
    """Megatron's GatedDeltaNet in_proj holds, on each TP rank, [q | k | v | z | b | a] of its key heads (and of the
    value heads that share them); `parts` says where HF keeps each of the six, in that order (Qwen3-Next groups them
    per key head in two tensors, Qwen3.5 keeps each part whole in its own: models/linear_attention.py)."""

    key_heads: int
    parts: tuple[HeadSlices, ...]

    def local_shape(self, hf_shapes, size):
        return (sum(shape[0] for shape in hf_shapes) // size, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        per_rank = self.key_heads // size
        out, at = [], 0
        for part in self.parts:
            for head in range(rank * per_rank, (rank + 1) * per_rank):
                start = part.start + head * part.stride
                out.append(along(hf_names[part.tensor], hf_shapes[part.tensor], 0, start, start + part.width, at))
                at += part.width
        return out


class Stacked(Layout):
    """The HF tensors one after another along dim 0, whole on every TP rank (the A matrices of the LoRA adapters of
    a fused layer's projections: models/lora.py)."""

    def local_shape(self, hf_shapes, size):
        return (sum(shape[0] for shape in hf_shapes), *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        starts = [0]
        for shape in hf_shapes:
            starts.append(starts[-1] + shape[0])
        return [along(name, shape, 0, 0, shape[0], start) for name, shape, start in zip(hf_names, hf_shapes, starts)]


@dataclass
class Entry:
    hf_names: tuple[str, ...]
    layout: Layout
    hf_shapes: tuple[Shape, ...]

    def local_shape(self, size: int) -> Shape:
        return tuple(self.layout.local_shape(list(self.hf_shapes), size))

    def regions(self, rank: int, size: int) -> list[Region]:
        return self.layout.regions(list(self.hf_names), list(self.hf_shapes), rank, size)


def shard_from_hf(entry: Entry, hf_tensors: list[torch.Tensor], rank: int, size: int) -> torch.Tensor:
    """TP shard `rank` of a Megatron parameter built from its full HF tensors (vocabulary padding is zero)."""
    for name, tensor, shape in zip(entry.hf_names, hf_tensors, entry.hf_shapes):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"Tensor '{name}' has shape {tuple(tensor.shape)} in the checkpoint but the model's "
                             f"config.json implies {tuple(shape)}.")
    by_name = dict(zip(entry.hf_names, hf_tensors))
    shard = hf_tensors[0].new_zeros(entry.local_shape(size))
    for region in entry.regions(rank, size):
        local_view(shard, region).copy_(hf_view(by_name[region.hf_name], region))
    return shard


def hf_module(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'q_proj': the module PEFT's target_modules name."""
    return hf_name.split(".")[-2]


def adapted_parts(entry: Entry, modules: tuple[str, ...]) -> list[int]:
    """The indices of `entry`'s HF tensors whose modules are among `modules` (the projections LoRA adapts)."""
    return [i for i, name in enumerate(entry.hf_names) if hf_module(name) in modules]


def is_row_parallel(entry: Entry) -> bool:
    """Whether the entry's layer splits its input over TP (linear_proj, linear_fc2), not its output."""
    return isinstance(entry.layout, Split) and entry.layout.dim == 1
