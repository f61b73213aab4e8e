"""Megatron <-> Hugging Face weight names and layouts: the one table that loading, export, resharding and
checkpoint conversion all use.

A `Layout` says how the HF tensor(s) of one Megatron parameter become that parameter's tensor-parallel
shard (`shard`) and how the TP shards become the HF tensor(s) again (`merge`). A family table lists,
for each Megatron parameter name, its HF name(s) and layout. Adding a family = adding a table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class Layout:
    """Full HF tensors <-> one TP shard of a Megatron parameter."""

    def shard(self, hf: list[torch.Tensor], rank: int, size: int) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


class Replicated(Layout):
    """Same tensor on every TP rank (norms)."""

    def shard(self, hf, rank, size):
        return hf[0]

    def merge(self, shards):
        return [shards[0]]


@dataclass
class Split(Layout):
    """Split along `dim` (dim 0: column-parallel, dim 1: row-parallel)."""

    dim: int

    def shard(self, hf, rank, size):
        return hf[0].chunk(size, dim=self.dim)[rank]

    def merge(self, shards):
        return [torch.cat(shards, dim=self.dim)]


@dataclass
class PaddedVocab(Layout):
    """Embedding / output rows: Megatron pads the vocabulary to `padded`; the padding rows are dropped on export."""

    vocab: int
    padded: int

    def shard(self, hf, rank, size):
        full = hf[0]
        if self.padded > self.vocab:
            full = torch.cat([full, full.new_zeros(self.padded - self.vocab, *full.shape[1:])])
        return full.chunk(size, dim=0)[rank]

    def merge(self, shards):
        return [torch.cat(shards, dim=0)[: self.vocab]]


@dataclass
class FusedQKV(Layout):
    """Megatron's linear_qkv holds, per query group, [the group's q heads, its k head, its v head]; TP splits
    whole groups. HF keeps q, k and v apart. Works for weights ([out, in]) and biases ([out])."""

    groups: int
    heads: int
    head_dim: int

    def _group_rows(self):
        return self.heads // self.groups * self.head_dim, self.head_dim

    def shard(self, hf, rank, size):
        q, k, v = hf
        q_rows, kv_rows = self._group_rows()
        tail = q.shape[1:]
        grouped = torch.cat([q.reshape(self.groups, q_rows, *tail), k.reshape(self.groups, kv_rows, *tail),
                             v.reshape(self.groups, kv_rows, *tail)], dim=1)
        return grouped.chunk(size, dim=0)[rank].reshape(-1, *tail)

    def merge(self, shards):
        q_rows, kv_rows = self._group_rows()
        full = torch.cat(shards, dim=0)
        tail = full.shape[1:]
        q, k, v = full.reshape(self.groups, q_rows + 2 * kv_rows, *tail).split([q_rows, kv_rows, kv_rows], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]


class FusedGateUp(Layout):
    """Megatron's linear_fc1 of a gated MLP holds [gate shard; up shard] on each TP rank."""

    def shard(self, hf, rank, size):
        gate, up = hf
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)

    def merge(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


@dataclass
class Entry:
    hf_names: tuple[str, ...]
    layout: Layout


# Transformer-Engine layer specs fuse the pre-attention and pre-MLP norms into the following linear layer;
# their parameters are the same tensors as the local spec's norm weights.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class DenseTable:
    """Llama, Qwen2 (QKV bias) and Qwen3 (QK-norm): they share names, differing only in optional parameters."""

    def __init__(self, hf_config: dict, padded_vocab: int):
        heads = hf_config["num_attention_heads"]
        groups = hf_config.get("num_key_value_heads") or heads
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
        qkv = FusedQKV(groups=groups, heads=heads, head_dim=head_dim)
        vocab = PaddedVocab(hf_config["vocab_size"], padded_vocab)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
        self.layer = {
            "input_layernorm.weight": Entry(("model.layers.{i}.input_layernorm.weight",), Replicated()),
            "self_attention.linear_qkv.weight": Entry(tuple(attn + p + "_proj.weight" for p in "qkv"), qkv),
            "self_attention.linear_qkv.bias": Entry(tuple(attn + p + "_proj.bias" for p in "qkv"), qkv),
            "self_attention.q_layernorm.weight": Entry((attn + "q_norm.weight",), Replicated()),
            "self_attention.k_layernorm.weight": Entry((attn + "k_norm.weight",), Replicated()),
            "self_attention.linear_proj.weight": Entry((attn + "o_proj.weight",), Split(dim=1)),
            "pre_mlp_layernorm.weight": Entry(("model.layers.{i}.post_attention_layernorm.weight",), Replicated()),
            "mlp.linear_fc1.weight": Entry((mlp + "gate_proj.weight", mlp + "up_proj.weight"), FusedGateUp()),
            "mlp.linear_fc2.weight": Entry((mlp + "down_proj.weight",), Split(dim=1)),
        }
        # With tied embeddings the last pipeline stage keeps its own copy of the embedding as output layer.
        output_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        self.other = {
            "embedding.word_embeddings.weight": Entry(("model.embed_tokens.weight",), vocab),
            "decoder.final_layernorm.weight": Entry(("model.norm.weight",), Replicated()),
            "output_layer.weight": Entry((output_name,), vocab),
        }

    def lookup(self, megatron_name: str, layer_offset: int) -> Entry:
        """The HF names (layer index resolved to the global layer) and layout of a local Megatron parameter."""
        match = _LAYER.match(megatron_name)
        if match is None:
            if megatron_name not in self.other:
                raise KeyError(f"No Hugging Face name for Megatron parameter '{megatron_name}'")
            return self.other[megatron_name]
        local, suffix = int(match.group(1)), _TE_ALIASES.get(match.group(2), match.group(2))
        if suffix not in self.layer:
            raise KeyError(f"No Hugging Face name for Megatron parameter '{megatron_name}'")
        entry = self.layer[suffix]
        names = tuple(n.format(i=local + layer_offset) for n in entry.hf_names)
        return Entry(names, entry.layout)

    def exported(self, megatron_name: str) -> bool:
        """Whether export writes this parameter (a tied output layer is the embedding, written once)."""
        return not (self.tied and megatron_name == "output_layer.weight")


SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


def table_for(hf_config: dict, padded_vocab: int) -> DenseTable:
    family = hf_config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"Model family '{family}' (config.json model_type) is not supported yet; "
                         f"supported: {', '.join(SUPPORTED_FAMILIES)}.")
    return DenseTable(hf_config, padded_vocab)
