"""`python -m rl_megatron.bench reshard --tp 2 --pp 2 --json` (an MoE model: `--moe --ep 2`): Megatron shards ->
vLLM engines, one process per rank (gloo on CPU), the trainer's own sync path. The limit is a plain copy of the
same bytes by the same ranks at the same time, measured in the same run.

`--lora-rank R`: a LoRA policy whose engines load its adapters: after the sync of the (frozen) base, each sync sends
the adapters alone (`rl_megatron/resharding/adapters.py`); reported: their bytes and seconds, and their bytes over
the whole model's.

`--placement separate [--engines N]`: engines in processes of their own (rollout.placement=separate), sent the
weights by the actor's rank 0 over the broadcast group; the figure is model bytes per second of a whole sync
(each bucket gathered on rank 0 and broadcast, each engine's copy into its parameters), the limit a copy of
the model's bytes. The sender holds a bucket of the weights at a time, not the model."""
from __future__ import annotations

import statistics
import time

import torch

PEAK_SYNCS = 3  # untimed syncs whose peak extra memory is measured


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_extra_rss(fn) -> int:
    """Bytes by which this process's own resident memory peaked above its level before `fn()` (Linux). Pages of
    other ranks' shared buffers that `fn` maps are theirs (counted as their channel's buffer), not ours."""
    before, shared_before = _status_kib("VmRSS"), _status_kib("RssShmem")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    fn()
    mapped = max(0, _status_kib("RssShmem") - shared_before)
    return max(0, _status_kib("VmHWM") - before - mapped) * 1024


def plain_copy(nbytes: int):
    """The limit's copy: `nbytes` from one buffer into another, every byte of the source written first. A source
    never written reads the kernel's one zero page from cache, not memory: 1.5x faster than a real copy here."""
    src, dst = torch.full((nbytes,), 7, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)


def _timed_together(fns, repeats: int) -> list[float]:
    """Median seconds of each of `fns` run by every rank at once (from a barrier to the last rank's end), the
    functions taking turns in each repeat, so that a busy moment of the machine falls on all of them alike."""
    import torch.distributed as dist

    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def measure_rank(cfg, repeats: int) -> dict:
    import torch.distributed as dist

    from rl_megatron.rollout.engine import engine_lora_rank
    from rl_megatron.models.hf_config import model_config
    from rl_megatron.resharding import Resharder, engine_mismatches, export_hf_state_dict
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = model_config(cfg)
    actor = MegatronActor(cfg, hf, optimizer_steps=10)
    rank = dist.get_rank()
    engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.model.dtype, seed=rank // cfg.rollout.tensor_parallel_size,
                        lora_rank=engine_lora_rank(cfg))
    try:
        sources = actor.weight_sources()
        resharder = Resharder(*sources, engine.sync_targets(), bucket_bytes=cfg.resharding.bucket_mb << 20,
                              channel=cfg.resharding.channel)
        resharder.sync()  # warm-up: first touch of the buffers, shared-memory handshakes
        copy = plain_copy(resharder.plan.bytes_into(rank))  # the limit: the same bytes copied, in turns with syncs
        copy()
        stats = []
        seconds, memcpy_seconds = _timed_together([lambda: stats.append(resharder.sync()), copy], repeats)
        # The peak from syncs of their own: reading /proc around a timed sync would add to its time.
        peaks = [peak_extra_rss(resharder.sync) for _ in range(PEAK_SYNCS)]
        engine.weights_updated()
        resharder.verify()  # raises, naming the tensor, if any piece differs
        state = [export_hf_state_dict(actor.chunks, actor.table)]
        dist.broadcast_object_list(state, src=0)
        exact = not engine_mismatches(engine.sync_targets(), state[0])
        kept = resharder.channel.owned_bytes
        resharder.close()
        nbytes = resharder.plan.bytes_into(rank)
        largest = max(t.numel() * t.element_size() for t, _ in sources[0].values())
        adapters = measure_adapter_sync(actor, engine, cfg, repeats) if engine_lora_rank(cfg) else {}
        # What a sync adds: its transient peak, plus the buffer the channel keeps between syncs.
        return adapters | {"exact": exact, "bytes": nbytes, "seconds": seconds, "memcpy_seconds": memcpy_seconds,
                "peak_extra_bytes": max(peaks) + kept, "largest_tensor_bytes": largest,
                "channel": resharder.channel_name,
                "seconds_in_place": statistics.median(s.seconds_in_place for s in stats),
                "bytes_in_place": stats[-1].bytes_in_place}
    finally:
        engine.release_process_groups()  # the rank exits next (run_distributed)


def measure_adapter_sync(actor, engine, cfg, repeats: int) -> dict:
    """The trainer's sync of a LoRA policy's adapters alone into this rank's engine, checked bit for bit."""
    from rl_megatron.resharding.adapters import AdapterSync

    adapters = AdapterSync(actor.chunks, cfg.actor.lora, cfg.model.path, engine, actor.chunks[0].config.params_dtype,
                           verify=True)
    try:
        received = [adapters.sync()]  # warm-up, and the check (raises if the engine's adapter differs)
        seconds, = _timed_together([lambda: received.append(adapters.sync())], repeats)
    finally:
        adapters.close()
    return {"adapter_bytes": received[-1], "adapter_seconds": seconds}


def send_rank(cfg, repeats: int, host: str, port: int, size: int) -> dict:
    """An actor rank of a separate-engine sync (`HybridWorker.sync_weights`'s path): every rank takes part in
    gathering each bucket, rank 0 broadcasts it."""
    import torch.distributed as dist

    from rl_megatron.bench.measure import timed
    from rl_megatron.models.hf_config import model_config
    from rl_megatron.resharding import checksum
    from rl_megatron.resharding.broadcast import SENDER, BroadcastSender, weight_group
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, model_config(cfg), optimizer_steps=10)
    rank = dist.get_rank()
    group = weight_group(host, port, SENDER, size) if rank == 0 else None
    sender = BroadcastSender(*actor.weight_sources(), group, cfg.resharding.bucket_mb << 20)
    try:
        sender.send()  # warm-up
        peaks = []
        seconds, = _timed_together([lambda: peaks.append(peak_extra_rss(sender.send))], repeats)
        # What a sync adds on the sender: its transient peak, plus the buffers kept between syncs.
        kept = (sender.buffer.nbytes if rank == 0 else 0) + sender.resharder.channel.owned_bytes
    finally:
        sender.close()
    state = actor.hf_state_dict()  # what the engines must have received (after the timing: a full copy)
    if rank:
        return {}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    memcpy_seconds = timed(plain_copy(nbytes), repeats)
    return {"bytes": nbytes, "seconds": seconds, "memcpy_seconds": memcpy_seconds,
            "peak_extra_bytes": max(peaks) + kept,
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in state.values()),
            "checksums": {name: checksum(t) for name, t in state.items()}}


def receive_rank(cfg, syncs: int, host: str, port: int, size: int) -> dict:
    """An engine worker of a separate-engine sync (`RolloutWorker.sync_weights`'s path)."""
    import torch.distributed as dist

    from rl_megatron.resharding import engine_mismatches
    from rl_megatron.resharding import checksum
    from rl_megatron.resharding.broadcast import receive_weights, weight_group, write_engine_regions
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.model.dtype, seed=0)
    try:
        targets = engine.sync_targets()
        group = weight_group(host, port, 1 + dist.get_rank(), size)
        received = {}
        for _ in range(syncs):
            for tensors in receive_weights(group):
                write_engine_regions(targets, tensors)
                received.update({name: tensor.clone() for name, tensor in tensors.items()})
        engine.weights_updated()
        return {"mismatches": engine_mismatches(targets, received),
                "checksums": {name: checksum(t) for name, t in received.items()}}
    finally:
        engine.release_process_groups()  # the rank exits next (run_distributed)


def run_separate(args, cfg) -> dict:
    """Actor ranks and engine processes as two worlds at once, joined by the broadcast group."""
    from concurrent.futures import ThreadPoolExecutor

    from rl_megatron.workers.distributed import listen_store
    from rl_megatron.workers.spawn import run_distributed

    host, size = "127.0.0.1", 1 + args.engines
    broadcast_store = listen_store(host)  # the broadcast group's, listening until both worlds are done
    port = broadcast_store.port
    with ThreadPoolExecutor(1) as pool:
        engines = pool.submit(run_distributed, receive_rank, args.engines, args=(cfg, args.repeats + 1, host, port,
                                                                                  size), timeout=1800)
        sender = run_distributed(send_rank, args.tp * args.pp, args.tp, args.pp, ep=args.ep,
                                 args=(cfg, args.repeats, host, port, size), timeout=1800)[0]
        receivers = engines.result()
    gbps, memcpy_gbps = sender["bytes"] / sender["seconds"] / 1e9, sender["bytes"] / sender["memcpy_seconds"] / 1e9
    exact = all(not r["mismatches"] and r["checksums"] == sender["checksums"] for r in receivers)
    return {"bench": "reshard", "exact": exact, "bytes": sender["bytes"], "seconds": sender["seconds"],
            "gbps": gbps, "memcpy_gbps": memcpy_gbps, "ratio": gbps / memcpy_gbps,
            "peak_extra_bytes": sender["peak_extra_bytes"], "bucket_bytes": args.bucket_mb << 20,
            "largest_tensor_bytes": sender["largest_tensor_bytes"], "in_place_fraction": 0.0,
            "seconds_in_place": 0.0, "channel": "broadcast", "bucket_channel": "broadcast",
            "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "engine_tp": cfg.rollout.tensor_parallel_size,
                       "engine_processes": args.engines},
            "model": "qwen3_moe" if args.moe else "qwen2",
            "value": gbps * 1e9, "unit": "B/s", "limit_name": "memcpy B/s", "limit": memcpy_gbps * 1e9}


def run(args, model_dir: str) -> dict:
    from rl_megatron.preflight import load_config
    from rl_megatron.workers.spawn import run_distributed

    world = args.tp * args.pp * args.ep
    # Colocated engines default to the trainer's TP; separate ones to whole engines (a process each).
    engine_tp = args.engine_tp or (1 if args.placement == "separate" else args.tp)
    cfg = load_config(None, [f"model.path={model_dir}", "model.random_init=true", f"trainer.n_gpus_per_node={world}",
                             f"actor.tensor_model_parallel_size={args.tp}",
                             f"actor.pipeline_model_parallel_size={args.pp}",
                             f"actor.expert_model_parallel_size={args.ep}",
                             f"rollout.tensor_parallel_size={engine_tp}",
                             f"resharding.bucket_mb={args.bucket_mb}", f"resharding.channel={args.channel}",
                             "data.max_prompt_length=8", "rollout.max_tokens=8", "rollout.n=1",
                             f"actor.lora.rank={args.lora_rank}",
                             f"data.train_batch_size={world}", f"actor.ppo_mini_batch_size={world}",
                             "actor.micro_batch_size=1"])
    if args.placement == "separate":
        return run_separate(args, cfg)
    per_rank = run_distributed(measure_rank, world, args.tp, args.pp, ep=args.ep, args=(cfg, args.repeats),
                               timeout=1800)
    nbytes = sum(r["bytes"] for r in per_rank)
    seconds = max(r["seconds"] for r in per_rank)
    memcpy_seconds = max(r["memcpy_seconds"] for r in per_rank)
    gbps, memcpy_gbps = nbytes / seconds / 1e9, nbytes / memcpy_seconds / 1e9
    lora = {}
    if args.lora_rank:  # every rank's engine loads the whole adapter
        adapter_bytes = sum(r["adapter_bytes"] for r in per_rank)
        lora = {"lora_rank": args.lora_rank, "adapter_bytes": adapter_bytes,
                "adapter_seconds": max(r["adapter_seconds"] for r in per_rank),
                "adapter_bytes_ratio": adapter_bytes / nbytes}
    return lora | {"bench": "reshard", "exact": all(r["exact"] for r in per_rank), "bytes": nbytes, "seconds": seconds,
            "gbps": gbps, "memcpy_gbps": memcpy_gbps, "ratio": gbps / memcpy_gbps,
            "peak_extra_bytes": max(r["peak_extra_bytes"] for r in per_rank), "bucket_bytes": args.bucket_mb << 20,
            "largest_tensor_bytes": max(r["largest_tensor_bytes"] for r in per_rank),
            "in_place_fraction": sum(r["bytes_in_place"] for r in per_rank) / nbytes,
            "seconds_in_place": max(r["seconds_in_place"] for r in per_rank), "channel": args.channel,
            "bucket_channel": per_rank[0]["channel"],
            "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "engine_tp": engine_tp},
            "model": "qwen3_moe" if args.moe else "qwen2",
            # the limit's fields, as every benchmark reports them
            "value": gbps * 1e9, "unit": "B/s", "limit_name": "memcpy B/s", "limit": memcpy_gbps * 1e9}
