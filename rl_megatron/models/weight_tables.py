"""Megatron <-> Hugging Face weight names and layouts: the one table that loading, resharding into the rollout
engine and checkpoint conversion all use.

A `Layout` says which parts of the HF tensor(s) one tensor-parallel shard of a Megatron parameter holds, and
where: a list of `Region`s. Everything that moves weights (HF -> shards at load, shards -> vLLM at every
sync, shards -> HF files) copies regions; no code path has its own notion of a fused layout. A family table
lists, for each Megatron parameter name, its HF name(s) and layout; each model family (`models/family.py`)
builds its table from these.
"""
from __future__ import annotations

import re
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
    whole groups. HF keeps q, k and v apart. Works for weights ([out, in]) and biases ([out])."""

    groups: int
    heads: int
    head_dim: int

    def local_shape(self, hf_shapes, size):
        rows = (self.heads + 2 * self.groups) * self.head_dim // size
        return (rows, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        q_rows = self.heads // self.groups * self.head_dim
        kv_rows = self.head_dim
        per_rank = self.groups // size
        out = []
        for j in range(per_rank):
            group, base = rank * per_rank + j, j * (q_rows + 2 * kv_rows)
            out += [along(hf_names[0], hf_shapes[0], 0, group * q_rows, (group + 1) * q_rows, base),
                    along(hf_names[1], hf_shapes[1], 0, group * kv_rows, (group + 1) * kv_rows, base + q_rows),
                    along(hf_names[2], hf_shapes[2], 0, group * kv_rows, (group + 1) * kv_rows,
                          base + q_rows + kv_rows)]
        return out


class FusedGateUp(Layout):
    """Megatron's linear_fc1 of a gated MLP holds [gate shard; up shard] on each TP rank."""

    def local_shape(self, hf_shapes, size):
        return (2 * hf_shapes[0][0] // size, *hf_shapes[0][1:])

    def regions(self, hf_names, hf_shapes, rank, size):
        n = hf_shapes[0][0] // size
        return [along(hf_names[0], hf_shapes[0], 0, rank * n, (rank + 1) * n, 0),
                along(hf_names[1], hf_shapes[1], 0, rank * n, (rank + 1) * n, n)]


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


# The linear layers of a decoder layer that LoRA adapts (models/lora.py), each holding the HF projections its weight
# entry names (q/k/v, o, gate/up, down).
ADAPTABLE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")

# Transformer-Engine layer specs fuse the pre-attention and pre-MLP norms into the following linear layer;
# their parameters are the same tensors as the local spec's norm weights.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # Multi-head latent attention: its q and kv LoRA norms, fused into the up projections.
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron numbers the routed experts of a layer per expert-parallel rank; HF numbers them globally. One linear
# layer per expert (SequentialMLP) or one grouped GEMM (TEGroupedMLP: TE's GroupedLinear names expert j's
# weight `weight<j>`).
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


class DenseTable:
    """Llama, Qwen2 and Qwen3: they share names, differing only in optional parameters (the q/k/v biases and the
    per-head q/k norms), which the table holds when its family's model has them."""

    def __init__(self, hf_config: dict, padded_vocab: int, qkv_bias: bool = True, qk_layernorm: bool = True):
        hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        groups = hf_config.get("num_key_value_heads") or heads
        head_dim = hf_config.get("head_dim") or hidden // heads
        ffn, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
        q, kv = heads * head_dim, groups * head_dim
        qkv = FusedQKV(groups=groups, heads=heads, head_dim=head_dim)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.num_layers, self.experts = hf_config["num_hidden_layers"], 0  # routed experts per layer: none
        attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."

        def entry(names, layout, shapes):
            return Entry(tuple(names), layout, tuple(shapes))

        self.layer = {
            "input_layernorm.weight": entry(["model.layers.{i}.input_layernorm.weight"], Replicated(), [(hidden,)]),
            "self_attention.linear_qkv.weight": entry([attn + p + "_proj.weight" for p in "qkv"], qkv,
                                                      [(q, hidden), (kv, hidden), (kv, hidden)]),
            "self_attention.linear_proj.weight": entry([attn + "o_proj.weight"], Split(dim=1), [(hidden, q)]),
            "pre_mlp_layernorm.weight": entry(["model.layers.{i}.post_attention_layernorm.weight"], Replicated(),
                                              [(hidden,)]),
            "mlp.linear_fc1.weight": entry([mlp + "gate_proj.weight", mlp + "up_proj.weight"], FusedGateUp(),
                                           [(ffn, hidden), (ffn, hidden)]),
            "mlp.linear_fc2.weight": entry([mlp + "down_proj.weight"], Split(dim=1), [(hidden, ffn)]),
        }
        if qkv_bias:
            self.layer["self_attention.linear_qkv.bias"] = entry([attn + p + "_proj.bias" for p in "qkv"], qkv,
                                                                 [(q,), (kv,), (kv,)])
        if qk_layernorm:
            self.layer["self_attention.q_layernorm.weight"] = entry([attn + "q_norm.weight"], Replicated(),
                                                                    [(head_dim,)])
            self.layer["self_attention.k_layernorm.weight"] = entry([attn + "k_norm.weight"], Replicated(),
                                                                    [(head_dim,)])
        # With tied embeddings the last pipeline stage keeps its own copy of the embedding as output layer.
        output_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        vocab_layout = PaddedVocab(padded_vocab)
        self.other = {
            "embedding.word_embeddings.weight": entry(["model.embed_tokens.weight"], vocab_layout, [(vocab, hidden)]),
            "decoder.final_layernorm.weight": entry(["model.norm.weight"], Replicated(), [(hidden,)]),
            "output_layer.weight": entry([output_name], vocab_layout, [(vocab, hidden)]),
        }

    def hf_tensors(self, output_layer: bool = True) -> dict[str, Shape]:
        """Every HF tensor that loading a whole model of this table reads (`models.gpt.load_hf_weights` looks up
        each parameter here), with its shape: what a model folder must hold. In the table's order: the embedding,
        final norm and output layer, then layer by layer. Without `output_layer` (a critic, whose value head
        replaces the output layer) lm_head is not needed; with tied embeddings the output layer is the embedding."""
        needed: dict[str, Shape] = {}
        for name, entry in self.other.items():
            if output_layer or name != "output_layer.weight":
                needed.update(zip(entry.hf_names, entry.hf_shapes))
        for layer in range(self.num_layers):
            for entry in self.layer_entries(layer).values():
                per_expert = any("{e}" in name for name in entry.hf_names)
                for expert in range(self.experts) if per_expert else (None,):
                    needed.update((name.format(i=layer, e=expert), shape)
                                  for name, shape in zip(entry.hf_names, entry.hf_shapes))
        return needed

    # A folder's tensors are the table's HF names unless a family stores them otherwise (models/expert_stacks.py).
    def stored_shapes(self, needed: dict[str, Shape]) -> dict[str, Shape]:
        return needed

    def stored_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def stored_reader(self, get):
        return get

    def replace_attention(self, entries: dict[str, Entry]) -> None:
        """Another attention's entries in place of the q/k/v ones (multi-head latent attention)."""
        self.layer = {**{name: entry for name, entry in self.layer.items()
                         if not name.startswith("self_attention.")}, **entries}

    def layer_entries(self, layer: int) -> dict[str, Entry]:
        """The entries of layer `layer`'s parameters (every layer alike here)."""
        return self.layer

    def lookup(self, megatron_name: str, layer_offset: int, expert_offset: int = 0) -> Entry:
        """The HF names (layer and expert indices resolved to global ones: this chunk's first layer is
        `layer_offset`, this rank's first routed expert `expert_offset`), shapes and layout of a local Megatron
        parameter."""
        match = _LAYER.match(megatron_name)
        if match is None:
            if megatron_name not in self.other:
                raise KeyError(f"No Hugging Face name for Megatron parameter '{megatron_name}'")
            return self.other[megatron_name]
        local, suffix = int(match.group(1)), _TE_ALIASES.get(match.group(2), match.group(2))
        expert_index = None
        if (expert := _LOCAL_EXPERT.match(suffix)) is not None:
            expert_index, suffix = int(expert.group(1)), "mlp.experts." + expert.group(2)
        elif (expert := _GROUPED_EXPERT.match(suffix)) is not None:
            expert_index, suffix = int(expert.group(3)), f"mlp.experts.{expert.group(1)}.{expert.group(2)}"
        entries = self.layer_entries(local + layer_offset)
        if suffix not in entries:
            raise KeyError(f"No Hugging Face name for Megatron parameter '{megatron_name}'")
        entry = entries[suffix]
        global_expert = expert_offset + expert_index if expert_index is not None else None
        names = tuple(n.format(i=local + layer_offset, e=global_expert) for n in entry.hf_names)
        return Entry(names, entry.layout, entry.hf_shapes)


@dataclass(frozen=True)
class ExpertNames:
    """How an MoE family names a layer's router and experts in HF checkpoints."""

    block: str  # the layer's MoE module
    gate: str
    up: str
    down: str


class MoeTable(DenseTable):
    """MoE families: the dense family's attention and norms; the MLP of each routing layer (`sparse_layers`, every
    layer by default) is a router, `experts` routed experts of width `expert_width` and optionally shared experts
    (`shared`: their HF module, width, and the HF name of their sigmoid gate or None); the other layers keep the
    dense MLP. Experts are stored per expert under HF names (what transformers' save_pretrained writes and vLLM
    loads). They split over tensor-parallel ranks like a dense MLP: Megatron's expert-TP size defaults to the TP
    size, and nothing here sets it. With `expert_bias` the router holds the per-expert score bias of aux-loss-free
    balancing (a buffer in Megatron, HF's gate.e_score_correction_bias)."""

    def __init__(self, hf_config: dict, padded_vocab: int, names: ExpertNames, experts: int, expert_width: int,
                 qkv_bias: bool, qk_layernorm: bool, sparse_layers: list[bool] | None = None,
                 shared: tuple[str, int, str | None] | None = None, expert_bias: bool = False):
        super().__init__(hf_config, padded_vocab, qkv_bias, qk_layernorm)
        self.experts = experts
        self.sparse_layers = sparse_layers or [True] * self.num_layers
        hidden = hf_config["hidden_size"]
        block = f"model.layers.{{i}}.{names.block}."
        expert = block + "experts.{e}."
        self.layer.update({
            "mlp.router.weight": Entry((block + "gate.weight",), Replicated(), ((experts, hidden),)),
            "mlp.experts.linear_fc1.weight": Entry(
                (expert + names.gate + ".weight", expert + names.up + ".weight"), FusedGateUp(),
                ((expert_width, hidden), (expert_width, hidden))),
            "mlp.experts.linear_fc2.weight": Entry((expert + names.down + ".weight",), Split(dim=1),
                                                   ((hidden, expert_width),)),
        })
        if expert_bias:
            self.layer["mlp.router.expert_bias"] = Entry((block + "gate.e_score_correction_bias",), Replicated(),
                                                         ((experts,),))
        if shared is not None:
            module, width, gate = shared
            mlp = f"{block}{module}."
            self.layer.update({
                "mlp.shared_experts.linear_fc1.weight": Entry((mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                                                              FusedGateUp(), ((width, hidden), (width, hidden))),
                "mlp.shared_experts.linear_fc2.weight": Entry((mlp + "down_proj.weight",), Split(dim=1),
                                                              ((hidden, width),)),
            })
            if gate:
                self.layer["mlp.shared_experts.gate_weight"] = Entry((block + gate + ".weight",), Replicated(),
                                                                     ((1, hidden),))

    def layer_entries(self, layer: int) -> dict[str, Entry]:
        """A routing layer's entries lack the dense MLP; a dense layer's lack the router and experts."""
        routing = self.sparse_layers[layer]

        def held(name: str) -> bool:
            if name in DENSE_MLP:
                return not routing
            return routing or not name.startswith(MOE_MLP)

        return {name: entry for name, entry in self.layer.items() if held(name)}


# Megatron's MLP parameters of a dense layer, and the prefixes of a routing layer's.
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
MOE_MLP = ("mlp.router.", "mlp.experts.", "mlp.shared_experts.")


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's embedding/output rows: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple

