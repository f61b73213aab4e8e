"""LoRA adapters on Megatron's tensor-parallel linear layers (actor.lora): y = W x + (alpha / r) B A x, with W frozen
and A [r, in], B [out, r] trained, as PEFT computes it on a Hugging Face model.

Each adapter is PEFT's per HF module (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), laid into
Megatron's fused layers by the same weight table that lays out their weights (`models/weight_tables.py`): B's rows
follow W's rows, so B is split over the TP ranks exactly as W is, and linear_qkv / linear_fc1 hold one adapter per
HF projection they fuse.
- column-parallel layers (linear_qkv, linear_fc1; output split): A whole on every TP rank, B split like the output.
  A x is computed on every rank alike; its gradient is summed over the TP ranks in the backward (each rank's B
  shard sees its own part of the output), so A's gradient is whole and equal everywhere.
- row-parallel layers (linear_proj, linear_fc2; input split): A split like the input, B whole. The partial A x of
  each rank is summed over the TP group (reduce-scattered over the sequence under sequence parallelism, where each
  rank's B then sees its own tokens and its gradient is summed over TP by Megatron's finalize_model_grads, as for
  the norms).

Megatron-Bridge's PEFT LoRA (NVIDIA's own, `megatron.bridge.peft`) imports transformer_engine at module level, so it
cannot run with Megatron's local layers on a CPU; this module follows its pattern on GPU: Transformer Engine's
fused norm + linear layers give the adapters the normed input (`return_layernorm_output`), as its
`get_adapter_attributes_from_linear` does.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from safetensors.torch import save_file

from rl_megatron.config.choices import lora_modules
from rl_megatron.config.schema import LoraConfig
from rl_megatron.models.weight_layouts import (Entry, FusedGateUp, Replicated, Split, Stacked, adapted_parts, hf_view,
                                              is_row_parallel, local_view, shard_from_hf)
from rl_megatron.models.weight_tables import ADAPTABLE_LINEARS, DenseTable

_ADAPTED = re.compile(rf"^(decoder\.layers\.\d+\.({'|'.join(map(re.escape, ADAPTABLE_LINEARS))})|output_layer)$")
ADAPTER = "adapter"  # the adapter's attribute on its linear layer: parameters `<layer>.adapter.lora_A` / `.lora_B`


def is_adapter_parameter(name: str) -> bool:
    return f".{ADAPTER}." in name


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer (weight table entry `entry`) on this TP rank: `parts` of its HF
    tensors get one each. lora_A stacks the parts' A ([parts x r, in]), or holds this rank's input columns of the
    one A of a row-parallel layer; lora_B holds this rank's rows of the parts' B in the layer's own row layout.
    `a_entry` and `b_entry` lay out lora_A and lora_B as the weight table lays out weights (HF names such as
    model.layers.0.self_attn.q_proj.lora_A.weight, PEFT's without its prefix)."""

    def __init__(self, entry: Entry, parts: list[int], lora: LoraConfig, row_parallel: bool, tp_group,
                 sequence_parallel: bool, dtype: torch.dtype, seed: int):
        super().__init__()
        r, rank, size = lora.rank, tp_group.rank(), tp_group.size()
        self.scale, self.row_parallel, self.tp_group = lora.alpha / r, row_parallel, tp_group
        self.sequence_parallel, self.enabled = sequence_parallel and size > 1, True
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        modules = [name.removesuffix(".weight") for name in entry.hf_names]
        a_names = tuple(f"{modules[p]}.lora_A.weight" for p in parts)
        a_shapes = tuple((r, entry.hf_shapes[p][1]) for p in parts)
        self.trained = {*a_names, *(f"{modules[p]}.lora_B.weight" for p in parts)}
        if row_parallel:  # A split like W's input, B whole
            self.a_entry = Entry(a_names, Split(dim=1), a_shapes)
            self.b_entry = Entry((f"{modules[0]}.lora_B.weight",), Replicated(), ((entry.hf_shapes[0][0], r),))
        else:  # A whole, B's rows where W's rows are (the same layout, r columns)
            self.a_entry = Entry(a_names, Stacked(), a_shapes)
            self.b_entry = Entry(tuple(f"{m}.lora_B.weight" for m in modules), entry.layout,
                                 tuple((shape[0], r) for shape in entry.hf_shapes))
        a = shard_from_hf(self.a_entry, [initial_a(name, *shape, lora.init, seed)
                                         for name, shape in zip(a_names, a_shapes)], rank, size)
        self.lora_A = torch.nn.Parameter(a.to(dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.b_entry.local_shape(size), dtype=dtype))
        if not row_parallel:
            # mask[row, k * r:(k + 1) * r] = 1 where B's row belongs to the k-th part: the parts' B side by side,
            # each multiplying its own A's output (rows of projections without an adapter stay out).
            mask = torch.zeros(self.lora_B.shape[0], len(parts) * r, dtype=dtype)
            for region in self.b_entry.regions(rank, size):
                if region.hf_name in self.trained:
                    k = a_names.index(region.hf_name.replace(".lora_B.", ".lora_A."))
                    mask[_rows(region), k * r:(k + 1) * r] = 1
            self.register_buffer("mask", mask, persistent=False)
        # What Megatron's gradient clipping and checkpointing read: which parameters are split over TP.
        set_tensor_model_parallel_attributes(self.lora_A, row_parallel, 1, 1)
        set_tensor_model_parallel_attributes(self.lora_B, not row_parallel, 0, 1)
        if row_parallel and self.sequence_parallel:  # each rank's B sees its own tokens: summed over TP
            self.lora_B.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output on this rank, shaped like the layer's: x is the layer's input as it receives it."""
        x = self.dropout(x)
        if self.row_parallel:
            h = F.linear(x, self.lora_A)
            if self.tp_group.size() > 1:
                h = (reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                     else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
            return F.linear(h, self.lora_B) * self.scale
        if self.sequence_parallel:  # every rank's A sees every token; each keeps its own tokens' input gradient
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        h = F.linear(x, self.lora_A)
        if self.tp_group.size() > 1:
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        r = self.lora_B.shape[1]
        blocks = self.lora_B.repeat(1, self.mask.shape[1] // r) * self.mask
        return F.linear(h, blocks) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A in the layer's weight layout on this rank: what merging the adapters adds to W."""
        if self.row_parallel:
            return self.lora_B @ self.lora_A * self.scale
        r = self.lora_B.shape[1]
        return (self.lora_B.repeat(1, self.mask.shape[1] // r) * self.mask) @ self.lora_A * self.scale

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole HF-named adapters (`full`'s names) into this rank's shards."""
        rank, size = self.tp_group.rank(), self.tp_group.size()
        for param, entry in ((self.lora_A, self.a_entry), (self.lora_B, self.b_entry)):
            whole = [tensors[n] if n in self.trained else torch.zeros(shape)
                     for n, shape in zip(entry.hf_names, entry.hf_shapes)]
            param.copy_(shard_from_hf(entry, whole, rank, size))

    def full(self, of_gradients: bool = False) -> dict[str, torch.Tensor]:
        """The whole adapters (or their gradients, as DDP holds them) by HF name, gathered from the TP ranks."""
        out = {}
        for param, entry in ((self.lora_A, self.a_entry), (self.lora_B, self.b_entry)):
            local = (param.main_grad if of_gradients else param).detach().contiguous()
            size = self.tp_group.size()
            if isinstance(entry.layout, (Stacked, Replicated)):
                shards = [local] * size
            else:
                shards = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(shards, local, group=self.tp_group)
            whole = {n: local.new_zeros(shape) for n, shape in zip(entry.hf_names, entry.hf_shapes)}
            for rank, shard in enumerate(shards):
                for region in entry.regions(rank, size):
                    hf_view(whole[region.hf_name], region).copy_(local_view(shard, region))
            out.update((n, t) for n, t in whole.items() if n in self.trained)
        return out


def _rows(region) -> slice:
    return slice(region.origin[0], region.origin[0] + region.stop[0] - region.start[0])


def initial_a(hf_name: str, rank: int, in_features: int, init: str, seed: int) -> torch.Tensor:
    """A of the HF module `hf_name` as PEFT initialises it (kaiming: nn.Linear's default; gaussian: N(0, 1/r)),
    drawn whole from `seed` and the adapter's name: every rank and layout starts from the same adapters."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_name.encode()))
    a = torch.empty(rank, in_features)
    if init == "gaussian":
        return a.normal_(std=1 / rank, generator=generator)
    bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    return a.uniform_(-bound, bound, generator=generator)


def _with_adapter(module, args, output):
    """Forward hook of an adapted linear layer: (W x [+ b], bias) -> (W x + adapters(x), bias)."""
    adapter = getattr(module, ADAPTER)
    if getattr(module, "return_layernorm_output", False):  # TE's fused norm + linear: the adapters read the norm
        (out, x), bias = output
    else:
        (out, bias), x = output, args[0]
    return (out + adapter(x), bias) if adapter.enabled else (out, bias)


def _sharded_state_dict(module, linear_state, gate_up: bool, prefix: str = "", sharded_offsets: tuple = (),
                        metadata: dict | None = None) -> dict:
    """An adapted layer's entries in distributed checkpoints: the layer's own, and its adapters split over TP as
    they are held (B like the output of a column-parallel layer, A like the input of a row-parallel one; the fused
    gate/up rows as Megatron saves linear_fc1's weight), so that a run resumes at any layout."""
    adapter, own = getattr(module, ADAPTER), f"{prefix}{ADAPTER}."
    state = {k: v for k, v in linear_state(prefix, sharded_offsets, metadata).items() if not k.startswith(own)}
    axis = {"lora_A": 1} if adapter.row_parallel else {"lora_B": 0}
    adapters = make_sharded_tensors_for_checkpoint({"lora_A": adapter.lora_A, "lora_B": adapter.lora_B}, own, axis,
                                                   sharded_offsets, tp_group=adapter.tp_group)
    if gate_up:
        singleton = (metadata or {}).get("singleton_local_shards", False)
        adapters[f"{own}lora_B"] = apply_swiglu_sharded_factory(adapters[f"{own}lora_B"], sharded_offsets, singleton)
    if prefix.endswith("output_layer."):  # B's rows follow the padded vocabulary, whose padding depends on TP
        adapters[f"{own}lora_B"].allow_shape_mismatch = True
    return state | adapters


def add_adapters(chunk: torch.nn.Module, table: DenseTable, lora: LoraConfig, layer_offset: int, seed: int) -> int:
    """Adapters on the layers of `chunk` (a model chunk whose first layer is global layer `layer_offset`) that hold
    the modules of actor.lora.target_modules; returns how many layers got one."""
    wanted, adapted = lora_modules(lora.target_modules), 0
    for name, module in list(chunk.named_modules()):
        if _ADAPTED.match(name) is None:
            continue
        entry = table.lookup(f"{name}.weight", layer_offset)
        parts = adapted_parts(entry, wanted)
        if not parts:
            continue
        if module.weight is None:  # the output layer of tied embeddings (pre-flight refuses lm_head there)
            raise ValueError(f"{name} shares the embedding's weight: LoRA on lm_head needs untied embeddings")
        row_parallel = is_row_parallel(entry)
        group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        if hasattr(module, "return_layernorm_output"):  # Transformer Engine: the normed input, on this rank
            module.return_layernorm_output = True
            module.return_layernorm_output_gathered = False
        module.add_module(ADAPTER, LoraAdapter(entry, parts, lora, row_parallel, group,
                                               bool(getattr(module, "sequence_parallel", False)),
                                               module.weight.dtype, seed).to(module.weight.device))
        module.register_forward_hook(_with_adapter)
        module.sharded_state_dict = functools.partial(_sharded_state_dict, module, module.sharded_state_dict,
                                                      isinstance(entry.layout, FusedGateUp))
        adapted += 1
    return adapted


def freeze_base(chunks: list[torch.nn.Module]) -> None:
    """Only the adapters train: every other parameter keeps its value and gets no gradient (nor optimizer state).
    The frozen embedding's output is made to need a gradient (PEFT's enable_input_require_grads): a recomputed
    layer (actor.recompute_granularity=full) runs its backward only for an input that needs one, and would
    otherwise leave its adapters without gradients."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_adapter_parameter(name))
        if getattr(chunk, "pre_process", False):
            chunk.embedding.register_forward_hook(_needs_grad)


def _needs_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(torch.is_grad_enabled())


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]):
    """The base model's outputs: every adapter of `chunks` skipped (the reference policy of a LoRA actor)."""
    adapters = adapters_of(chunks)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def adapters_of(chunks: list[torch.nn.Module]) -> list[LoraAdapter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]


def adapter_tensors(chunks: list[torch.nn.Module], of_gradients: bool = False) -> dict[str, torch.Tensor]:
    """This pipeline stage's whole adapters (or their gradients) by HF name (a collective over the TP group)."""
    return {name: tensor for adapter in adapters_of(chunks) for name, tensor in adapter.full(of_gradients).items()}


def load_adapter_tensors(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Whole HF-named adapters into this rank's shards (every adapter of `chunks` must be there)."""
    for adapter in adapters_of(chunks):
        missing = adapter.trained - set(tensors)
        if missing:
            raise KeyError(f"No adapter tensor {sorted(missing)[0]} among the {len(tensors)} given")
        adapter.load(tensors)


class MergedWeights(torch.nn.Module):
    """The adapted layers' weights with their adapters merged, W + (alpha / r) B A, in tensors of their own (the
    model's stay the frozen base): what the rollout engines receive at each weight sync. Its tensors are parameters
    that never train, so that what shares a model's parameters with the engines (`resharding.share_parameters`)
    shares these too."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.layers = [(module.weight, getattr(module, ADAPTER)) for chunk in chunks for module in chunk.modules()
                       if isinstance(getattr(module, ADAPTER, None), LoraAdapter)]
        self.merged = torch.nn.ParameterList(torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
                                             for weight, _ in self.layers)

    def substitutes(self) -> dict[int, torch.Tensor]:
        """id(a base weight) -> the tensor the engines read in its place."""
        return {id(weight): merged for (weight, _), merged in zip(self.layers, self.merged)}

    @torch.no_grad()
    def refresh(self) -> None:
        """The merged weights of the adapters as they are now (before each weight sync)."""
        for (weight, adapter), merged in zip(self.layers, self.merged):
            torch.add(weight, adapter.delta_weight(), out=merged.data)


PEFT_PREFIX = "base_model.model."  # PEFT's names: the model's, under its wrapper


def peft_adapter_files(tensors: dict[str, torch.Tensor], lora: dict, base_model: str, out_dir: str) -> None:
    """A PEFT adapter folder: adapter_model.safetensors (PEFT's names) and adapter_config.json (actor.lora's keys
    under PEFT's names), which PeftModel.from_pretrained and vLLM's LoRA requests load."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({PEFT_PREFIX + name: t.contiguous() for name, t in sorted(tensors.items())},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
              "target_modules": sorted({name.split(".")[-3] for name in tensors}), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
