"""Megatron <-> Hugging Face weight names and layouts: the one table that loading, resharding into the rollout
engine and checkpoint conversion all use.

A family table lists, for each Megatron parameter name, its HF name(s), shapes and layout (an `Entry`; the layouts
and their regions: `weight_layouts.py`); each model family (`models/family.py`) builds its table from these.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rl_megatron.models.weight_layouts import Entry, FusedGateUp, FusedQKV, PaddedVocab, Replicated, Shape, Split


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
    per-head q/k norms), which the table holds when its family's model has them. `output_gate`: the q projection
    also holds each head's output gate (Qwen3-Next's gated attention)."""

    def __init__(self, hf_config: dict, padded_vocab: int, qkv_bias: bool = True, qk_layernorm: bool = True,
                 output_gate: bool = False):
        hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        groups = hf_config.get("num_key_value_heads") or heads
        head_dim = hf_config.get("head_dim") or hidden // heads
        # None where every layer routes over experts (Qwen3.5-MoE's config.json has no intermediate_size)
        ffn, vocab = hf_config.get("intermediate_size"), hf_config["vocab_size"]
        q, kv = heads * head_dim, groups * head_dim
        qkv = FusedQKV(groups=groups, heads=heads, head_dim=head_dim, gated=output_gate)
        q_rows = 2 * q if output_gate else q  # HF's q_proj rows
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.num_layers, self.experts = hf_config["num_hidden_layers"], 0  # routed experts per layer: none
        attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."

        def entry(names, layout, shapes):
            return Entry(tuple(names), layout, tuple(shapes))

        self.layer = {
            "input_layernorm.weight": entry(["model.layers.{i}.input_layernorm.weight"], Replicated(), [(hidden,)]),
            "self_attention.linear_qkv.weight": entry([attn + p + "_proj.weight" for p in "qkv"], qkv,
                                                      [(q_rows, hidden), (kv, hidden), (kv, hidden)]),
            "self_attention.linear_proj.weight": entry([attn + "o_proj.weight"], Split(dim=1), [(hidden, q)]),
            "pre_mlp_layernorm.weight": entry(["model.layers.{i}.post_attention_layernorm.weight"], Replicated(),
                                              [(hidden,)]),
        }
        if ffn is not None:
            self.layer.update({
                "mlp.linear_fc1.weight": entry([mlp + "gate_proj.weight", mlp + "up_proj.weight"], FusedGateUp(),
                                               [(ffn, hidden), (ffn, hidden)]),
                "mlp.linear_fc2.weight": entry([mlp + "down_proj.weight"], Split(dim=1), [(hidden, ffn)]),
            })
        if qkv_bias:
            self.layer["self_attention.linear_qkv.bias"] = entry([attn + p + "_proj.bias" for p in "qkv"], qkv,
                                                                 [(q_rows,), (kv,), (kv,)])
        if qk_layernorm:
            self.layer["self_attention.q_layernorm.weight"] = entry([attn + "q_norm.weight"], Replicated(),
                                                                    [(head_dim,)])
            self.layer["self_attention.k_layernorm.weight"] = entry([attn + "k_norm.weight"], Replicated(),
                                                                    [(head_dim,)])
        # With tied embeddings the last pipeline stage keeps its own copy of the embedding as output layer.
        output_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        vocab_layout = PaddedVocab(padded_vocab)
        self.linear_attention: tuple[dict[str, Entry], list[bool]] | None = None  # (entries, which layers)
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
        self.layer = with_attention(self.layer, entries)

    def add_linear_attention(self, entries: dict[str, Entry], layers: list[bool]) -> None:
        """A hybrid model's linear-attention entries (Qwen3-Next's Gated DeltaNet), in place of the q/k/v ones on
        the layers `layers` marks."""
        self.linear_attention = (entries, layers)

    def layer_entries(self, layer: int) -> dict[str, Entry]:
        """The entries of layer `layer`'s parameters (every layer alike but a hybrid's linear-attention ones)."""
        return self.with_own_attention(layer, self.layer)

    def with_own_attention(self, layer: int, entries: dict[str, Entry]) -> dict[str, Entry]:
        """`entries` with layer `layer`'s attention: the linear attention's where the layer has it."""
        if self.linear_attention is None or not self.linear_attention[1][layer]:
            return entries
        return with_attention(entries, self.linear_attention[0])

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
                 shared: tuple[str, int, str | None] | None = None, expert_bias: bool = False,
                 output_gate: bool = False):
        super().__init__(hf_config, padded_vocab, qkv_bias, qk_layernorm, output_gate)
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

        return self.with_own_attention(layer, {name: entry for name, entry in self.layer.items() if held(name)})


# Megatron's MLP parameters of a dense layer, and the prefixes of a routing layer's.
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
MOE_MLP = ("mlp.router.", "mlp.experts.", "mlp.shared_experts.")


def with_attention(entries: dict[str, Entry], attention: dict[str, Entry]) -> dict[str, Entry]:
    """`entries` with `attention`'s entries in place of its own attention's."""
    return {**{name: entry for name, entry in entries.items() if not name.startswith("self_attention.")}, **attention}


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's embedding/output rows: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple

