"""`python -m rl_megatron.bench reshard --tp 2 --pp 2 --json` (an MoE model: `--moe --ep 2`): Megatron shards ->
vLLM engines, one process per rank (gloo on CPU), the trainer's own sync path. The limit is a plain copy of the
same bytes by the same ranks at the same time, measured in the same run."""
from __future__ import annotations

import statistics
import time

import torch


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


def _timed_together(fn, repeats: int) -> float:
    """Median seconds of `fn` run by every rank at once (from a barrier to the last rank's end)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rank(cfg, repeats: int) -> dict:
    import torch.distributed as dist

    from rl_megatron.config import model_config
    from rl_megatron.resharding import Resharder, engine_mismatches, export_hf_state_dict, vllm_targets
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = model_config(cfg)
    actor = MegatronActor(cfg, hf, optimizer_steps=10)
    rank = dist.get_rank()
    engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.model.dtype, seed=rank // cfg.rollout.tensor_parallel_size,
                        eos_token_id=hf["eos_token_id"])
    try:
        sources = actor.weight_sources()
        resharder = Resharder(*sources, vllm_targets(engine.model()), bucket_bytes=cfg.resharding.bucket_mb << 20,
                              channel=cfg.resharding.channel)
        resharder.sync()  # warm-up: first touch of the buffers, shared-memory handshakes
        peaks, stats = [], []
        seconds = _timed_together(lambda: peaks.append(peak_extra_rss(lambda: stats.append(resharder.sync()))),
                                  repeats)
        engine.weights_updated()
        resharder.verify()  # raises, naming the tensor, if any piece differs
        state = [export_hf_state_dict(actor.chunks, actor.table)]
        dist.broadcast_object_list(state, src=0)
        exact = not engine_mismatches(engine.model(), state[0])
        kept = resharder.channel.owned_bytes
        resharder.close()
        nbytes = resharder.plan.bytes_into(rank)
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        memcpy_seconds = _timed_together(lambda: dst.copy_(src), repeats)
        largest = max(t.numel() * t.element_size() for t, _ in sources[0].values())
        # What a sync adds: its transient peak, plus the buffer the channel keeps between syncs.
        return {"exact": exact, "bytes": nbytes, "seconds": seconds, "memcpy_seconds": memcpy_seconds,
                "peak_extra_bytes": max(peaks) + kept, "largest_tensor_bytes": largest,
                "channel": resharder.channel_name,
                "seconds_in_place": statistics.median(s.seconds_in_place for s in stats),
                "bytes_in_place": stats[-1].bytes_in_place}
    finally:
        engine.close()


def run(args, model_dir: str) -> dict:
    from rl_megatron.config import load_config
    from rl_megatron.workers.spawn import run_distributed

    world = args.tp * args.pp * args.ep
    cfg = load_config(None, [f"model.path={model_dir}", "model.random_init=true", f"trainer.n_gpus_per_node={world}",
                             f"actor.tensor_model_parallel_size={args.tp}",
                             f"actor.pipeline_model_parallel_size={args.pp}",
                             f"actor.expert_model_parallel_size={args.ep}",
                             f"rollout.tensor_parallel_size={args.engine_tp or args.tp}",
                             f"resharding.bucket_mb={args.bucket_mb}", f"resharding.channel={args.channel}",
                             "data.max_prompt_length=8", "rollout.max_tokens=8", "rollout.n=1",
                             f"data.train_batch_size={world}", f"actor.ppo_mini_batch_size={world}",
                             "actor.micro_batch_size=1"])
    per_rank = run_distributed(measure_rank, world, args.tp, args.pp, ep=args.ep, args=(cfg, args.repeats),
                               timeout=1800)
    nbytes = sum(r["bytes"] for r in per_rank)
    seconds = max(r["seconds"] for r in per_rank)
    memcpy_seconds = max(r["memcpy_seconds"] for r in per_rank)
    gbps, memcpy_gbps = nbytes / seconds / 1e9, nbytes / memcpy_seconds / 1e9
    return {"bench": "reshard", "exact": all(r["exact"] for r in per_rank), "bytes": nbytes, "seconds": seconds,
            "gbps": gbps, "memcpy_gbps": memcpy_gbps, "ratio": gbps / memcpy_gbps,
            "peak_extra_bytes": max(r["peak_extra_bytes"] for r in per_rank), "bucket_bytes": args.bucket_mb << 20,
            "largest_tensor_bytes": max(r["largest_tensor_bytes"] for r in per_rank),
            "in_place_fraction": sum(r["bytes_in_place"] for r in per_rank) / nbytes,
            "seconds_in_place": max(r["seconds_in_place"] for r in per_rank), "channel": args.channel,
            "bucket_channel": per_rank[0]["channel"],
            "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "engine_tp": args.engine_tp or args.tp},
            "model": "qwen3_moe" if args.moe else "qwen2",
            # the limit's fields, as every benchmark reports them
            "value": gbps * 1e9, "unit": "B/s", "limit_name": "memcpy B/s", "limit": memcpy_gbps * 1e9}
