"""`python -m rl_megatron.bench recompute --json`: what activation recomputation saves and costs, one process.

Three actors with the same weights, one per `actor.recompute_granularity`: off, selective (the attention core) and
full (every layer, `recompute_method=uniform`, `recompute_num_layers=1`: only each layer's input is kept). For each:

- saved bytes: what autograd keeps for the backward pass of one training forward over one micro-batch (the whole
  batch by default), every saved tensor's storage counted once and the parameters' not at all
  (`saved_activation_bytes`); the forward ends at the logits, so the loss's own saved tensors (its log-softmax over
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

import torch

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.bench.measure import bench_config, random_batch, timed

# Each mode's actor.* keys (over no recomputation).
MODES = {
    "off": (),
    "selective": ("actor.recompute_granularity=selective",),
    "full": ("actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1"),
}


def saved_activation_bytes(model, batch: TrainBatch) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one training-mode forward of `model` (a
    `MegatronModel` of one chunk: no pipeline) over `batch` as one micro-batch. Each storage counts once (views,
    and tensors several operations save, share one); the parameters' storages not at all (they exist anyway)."""
    if len(model.model) != 1:
        raise ValueError("saved_activation_bytes measures one model chunk: build the model without pipeline stages.")
    (chunk,) = model.model
    parameters = {param.untyped_storage().data_ptr() for param in chunk.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # A saved tensor stays alive with the graph, so no two live storages share an address here.
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    batch = batch.padded_to_multiple(model.sequence_multiple).to(platform.device())
    ids = batch.input_ids
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    chunk.train(True)  # Megatron recomputes only in training mode
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunk(ids, positions, None)  # the graph (and what it saved) is dropped with the output
    return sum(saved.values())


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
