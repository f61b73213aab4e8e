"""`python -m rl_megatron.bench recompute --json`: what activation recomputation saves and costs, one process.

Three actors with the same weights, one per `actor.recompute_granularity`: off, selective (the attention core) and
full (every layer, `recompute_method=uniform`, `recompute_num_layers=1`: only each layer's input is kept). For each:

- saved bytes: what autograd keeps for the backward pass of one training forward over one micro-batch (the whole
  batch by default), every saved tensor's storage counted once and the parameters' and buffers' not at all
  (`saved_activation_bytes`; `saved_bytes` has them per decoder layer, which tests/distributed/test_memory_plan.py
  holds the memory plan to); the forward ends at the logits, so the loss's own saved tensors (its log-softmax over
  the vocabulary, the same in every mode) are left out;
- step time: the actor's update over the batch (forward, backward with the recomputation, optimizer step), the
  median of `--repeats` updates per mode, the modes taking turns (so that other load on the machine, or its drift,
  falls on every mode alike).

The figure is full recomputation's saved bytes; its limit, measured in the same run, the saved bytes without
recomputation (the ratio is the share of activation memory that full recomputation keeps). Default model: the
benchmarks' Qwen2 narrowed to hidden 256 (4 heads of 64, 1 KV head), 4 layers, vocabulary 4096 (4.9M parameters),
in float32 on CPU; a micro-batch of 4 sequences x 1024 tokens. Megatron's local attention (CPU, or a GPU without
Transformer Engine) keeps the [batch, heads, seq, seq] attention probabilities, which selective recomputation drops;
Transformer Engine's fused attention never stores them, so there selective recomputation saves little.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.bench.measure import bench_config, random_batch, timed
from rl_megatron.models.packed_attention import packed_seq_params
from rl_megatron.sequences import micro_batch

# Each mode's actor.* keys (over no recomputation).
MODES = {
    "off": (),
    "selective": ("actor.recompute_granularity=selective",),
    "full": ("actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1"),
}


@dataclass(frozen=True)
class SavedBytes:
    """What autograd keeps for the backward pass of one training forward, by where it was saved: each storage saved
    inside one decoder layer only is that layer's (`layers`, in order); what is saved outside the layers (the
    embedding's ids, the final norm's and output layer's inputs, full recomputation's checkpoints), or by several
    layers (the cached causal mask, the shared rotary frequencies), is `other`."""

    layers: tuple[int, ...]
    other: int

    @property
    def total(self) -> int:
        return sum(self.layers) + self.other


def saved_bytes(chunk, input_ids: torch.Tensor, position_ids: torch.Tensor, packed=None) -> SavedBytes:
    """`SavedBytes` of one training-mode forward of `chunk` (a whole model: no pipeline; optionally wrapped by DDP)
    over one micro-batch (`packed`: its packed-row parameters, `models.packed_attention.packed_seq_params`). Each
    storage counts once (views, and tensors several operations save, share one); the parameters' and buffers'
    storages not at all (they exist anyway)."""
    model = getattr(chunk, "module", chunk)  # Megatron's DDP wraps the GPTModel
    kept = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    where: dict[int, set] = {}  # storage address -> the layers (None: outside them) that saved it
    sizes: dict[int, int] = {}
    current: list = [None]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # A saved tensor stays alive with the graph, so no two live storages share an address here.
        if storage.data_ptr() not in kept:
            sizes[storage.data_ptr()] = storage.nbytes()
            where.setdefault(storage.data_ptr(), set()).add(current[0])
        return tensor

    def entering(index):
        return lambda module, args: current.__setitem__(0, index)

    layers = list(model.decoder.layers)
    hooks = [hook for index, layer in enumerate(layers)
             for hook in (layer.register_forward_pre_hook(entering(index)),
                          layer.register_forward_hook(lambda module, args, output: current.__setitem__(0, None)))]
    chunk.train(True)  # Megatron recomputes only in training mode
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            chunk(input_ids, position_ids, None, packed_seq_params=packed)  # the graph is dropped with the output
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = [0] * len(layers)
    other = 0
    for address, places in where.items():
        if len(places) == 1 and None not in places:
            per_layer[next(iter(places))] += sizes[address]
        else:
            other += sizes[address]
    return SavedBytes(layers=tuple(per_layer), other=other)


def saved_activation_bytes(model, batch: TrainBatch, packing: bool = False) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one training-mode forward of `model` (a
    `MegatronModel` of one chunk: no pipeline) over `batch` as one micro-batch, right-padded (or `packing`: its
    samples in one row), as `saved_bytes` counts them."""
    return saved_micro_batch_bytes(model, batch, packing).total


def saved_micro_batch_bytes(model, batch: TrainBatch, packing: bool = False) -> SavedBytes:
    """`saved_bytes` of `model` (a `MegatronModel` of one chunk) over `batch` as one micro-batch, formed as the
    model's passes form one (`sequences.micro_batch`: right-padded rows, or with `packing` one packed row)."""
    if len(model.model) != 1:
        raise ValueError("saved_activation_bytes measures one model chunk: build the model without pipeline stages.")
    micro = micro_batch(batch, list(range(batch.input_ids.shape[0])), packing, model.sequence_multiple)
    micro = micro.to_device(platform.device())
    packed = None if micro.cu_seqlens is None else packed_seq_params(micro.cu_seqlens, micro.input_ids.device)
    return saved_bytes(model.model[0], *micro.model_inputs(), packed)


def run(args, model_dir: str) -> dict:
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.distributed import init_distributed, listen_store
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = read_hf_config(model_dir)
    init_distributed(0, 1, listen_store("127.0.0.1"), 1, 1, seed=0)
    batch = random_batch(args, hf["vocab_size"])
    actors = {}
    for mode, overrides in MODES.items():  # the first one's random weights, copied into the others
        actors[mode] = MegatronActor(bench_config(args, model_dir, args.dtype, overrides), hf, optimizer_steps=100,
                                     initial=next(iter(actors.values()), None))
    off_actor = actors["off"]
    micro = batch.chunks(off_actor.batching.micro_batch_size)[0]
    saved = {mode: saved_activation_bytes(actor, micro) for mode, actor in actors.items()}
    batch.old_log_probs = off_actor.log_probs(batch).log_probs
    seconds = {mode: [] for mode in actors}
    for turn in range(1 + args.repeats):  # the first turn warms up
        for mode, actor in actors.items():
            step = timed(lambda: actor.update(batch), repeats=1, warmup=0)
            if turn:
                seconds[mode].append(step)
    modes = {mode: {"saved_bytes": saved[mode], "step_s": statistics.median(seconds[mode])} for mode in actors}
    full, off = saved["full"], saved["off"]
    return {"bench": "recompute", "value": full, "unit": "bytes", "ratio": full / off,
            "limit_name": "saved bytes without recomputation", "limit": off, "modes": modes,
            "step_time_ratio": modes["full"]["step_s"] / modes["off"]["step_s"],
            "micro_batch_tokens": micro.input_ids.numel(), "batch": args.batch, "seq": args.seq,
            "dtype": args.dtype, "layers": hf["num_hidden_layers"], "hidden": hf["hidden_size"],
            "params": sum(param.numel() for param in off_actor.chunks[0].parameters())}
