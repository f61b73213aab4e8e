"""The doctor's checks other than the model cycle: devices against the config, the installed stack, Megatron on one
device (`model_checks.py`), the collectives the run relies on (their bandwidth), host memory for what waits there,
GPU memory against the plan. Each returns a `Result`; none raises for a finding."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import time

import psutil
import torch
import torch.distributed as dist

from rl_megatron import platform
from rl_megatron.config import Config
from rl_megatron.config.pools import worker_pools
from rl_megatron.doctor.report import FAIL, PASS, SKIP, Result, gb_per_s
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.planning import memory
from rl_megatron.planning.plan import build_plan
from rl_megatron.platform.stack import stack_problems
from rl_megatron.workers.spawn import run_distributed

COLLECTIVE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}  # per transfer: large enough to measure bandwidth
REPEATS = 5
# What the engine and cluster checks need beyond torch, Megatron and transformers, and how to install it.
ENGINE_MODULES = ("ray", "vllm")
ENGINE_INSTALL = "pip install -r requirements-gpu.txt on GPU, make install on CPU"


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of `names` that this Python cannot import (found without importing them)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def needs_engines(name: str, missing: list[str]) -> Result | None:
    """The SKIP of a check that needs Ray and vLLM when `missing` names either, else None (the check applies)."""
    if not missing:
        return None
    return Result(name, SKIP, f"{' and '.join(missing)} not installed, which the engine and cluster checks need "
                  f"({ENGINE_INSTALL})")


def local_devices() -> tuple[int, str]:
    """(devices this machine offers, what they are): its GPUs, or its CPU cores standing for devices."""
    if platform.has_cuda():
        return torch.cuda.device_count(), "GPU"
    return os.cpu_count() or 1, "CPU slot"


def devices(cfg: Config) -> Result:
    """The config's pools against what this machine (and, with ray.address, the cluster) offers."""
    pools = worker_pools(cfg)
    per_node = max(pool.gpus_per_node for pool in pools)
    needed = sum(pool.nnodes * pool.gpus_per_node for pool in pools)
    have, kind = local_devices()
    figure = f"{have} {kind}(s) here; the config needs {per_node} per node, {needed} in all"
    if have < per_node:
        keys = ", ".join(sorted({f"{pool.gpus_key}={pool.gpus_per_node}" for pool in pools}))
        return Result("devices", FAIL, figure, f"lower {keys} to at most {have}, or run on nodes with more devices")
    return Result("devices", PASS, figure)


def stack() -> list[Result]:
    """torch is the build vLLM is linked against (without vLLM: SKIP); Transformer Engine imports (GPU only)."""
    skipped = needs_engines("stack: torch and vLLM", missing_modules(("vllm",)))
    problems = [] if skipped else stack_problems()
    results = [skipped or Result("stack: torch and vLLM", FAIL if problems else PASS, f"torch {torch.__version__}",
                                 "; ".join(problems))]
    if not platform.has_cuda():
        results.append(Result("stack: Transformer Engine", SKIP, "needs CUDA (Megatron's local layers run instead)"))
    elif importlib.util.find_spec("transformer_engine") is None:
        results.append(Result("stack: Transformer Engine", SKIP, "not installed: Megatron's local layers run "
                              "(pip install --no-build-isolation 'transformer_engine[pytorch]' for TE's kernels)"))
    else:
        try:
            import transformer_engine.pytorch  # noqa: F401  (imports its CUDA extension: the check)
            version = importlib.metadata.version("transformer_engine")
            results.append(Result("stack: Transformer Engine", PASS, f"transformer_engine {version}"))
        except Exception as err:  # an extension built against another torch fails here
            results.append(Result("stack: Transformer Engine", FAIL, f"{type(err).__name__}: {err}",
                                  "rebuild it against this torch: pip install --no-build-isolation "
                                  "'transformer_engine[pytorch]'"))
    return results


def _model_checks_on_rank(model_type: str, tied: bool) -> list[Result]:
    # Imported in the rank's process only: Megatron and transformers would add seconds to the doctor's start.
    from rl_megatron.doctor.model_checks import run_checks

    return run_checks(model_type, tied)


def megatron(cfg: Config) -> list[Result]:
    """A tiny model of the config's family (its tied embeddings too) on one of this machine's devices, in a
    one-rank world of its own (no Ray, no vLLM): `model_checks.py`."""
    hf = read_hf_config(cfg.model.path)
    [results] = run_distributed(_model_checks_on_rank, world_size=1,
                                args=(hf["model_type"], bool(hf.get("tie_word_embeddings", False))))
    return results


def _measure_collectives(nbytes: int) -> dict[str, float]:
    """On every rank: seconds of an all-reduce of `nbytes` and of the resharder's batched exchange (each rank
    sends `nbytes` to the next rank and receives from the previous one in one batch_isend_irecv), best of REPEATS."""
    device = platform.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    incoming = torch.empty_like(data)

    def timed(step) -> float:
        best = float("inf")
        for _ in range(REPEATS + 1):  # the first run sets the communicators up
            dist.barrier()
            start = time.perf_counter()
            step()
            if platform.has_cuda():
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def exchange():
        ops = [dist.P2POp(dist.isend, data, (rank + 1) % world), dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    all_reduce = timed(lambda: dist.all_reduce(data))
    seconds = {"all_reduce": all_reduce, "exchange": timed(exchange)}
    seconds["exact"] = float(torch.equal(incoming, data))
    return seconds


def collectives(cfg: Config) -> list[Result]:
    """All-reduce and batched point-to-point bandwidth among this machine's devices (NCCL on GPU, gloo on CPU)."""
    have, _ = local_devices()
    world = min(have, max(pool.gpus_per_node for pool in worker_pools(cfg)), 8 if platform.has_cuda() else 2)
    if world < 2:
        return [Result("collectives", SKIP, "one device: nothing to exchange")]
    nbytes = COLLECTIVE_BYTES[platform.device().type]
    ranks = run_distributed(_measure_collectives, world_size=world, args=(nbytes,), timeout=120)
    backend = "NCCL" if platform.has_cuda() else "gloo"
    slowest = {key: max(rank[key] for rank in ranks) for key in ("all_reduce", "exchange")}
    # An all-reduce (ring) moves 2 (n - 1) / n of the data through each rank: its bus bandwidth, as nccl-tests report.
    bus = gb_per_s(int(nbytes * 2 * (world - 1) / world), slowest["all_reduce"])
    results = [Result(f"collectives: all-reduce ({backend})", PASS,
                      f"{bus:.2f} GB/s bus bandwidth, {world} ranks, {nbytes >> 20} MiB")]
    exact = all(rank["exact"] for rank in ranks)
    results.append(Result(f"collectives: batched exchange ({backend})", PASS if exact else FAIL,
                          f"{gb_per_s(nbytes, slowest['exchange']):.2f} GB/s per rank, each sending and receiving",
                          "" if exact else "received bytes differ from those sent: check the interconnect and NCCL"))
    return results


def host_memory(cfg: Config) -> Result:
    """What waits in host memory between phases (the trainer's offloaded state, upper bound) against free memory
    and /dev/shm (Ray's object store, vLLM and, on CPU, the shared parameters live there)."""
    plan = build_plan(cfg, on_gpu=platform.has_cuda(), refuse_over_memory=False)
    per_node = max(pool.gpus_per_node * sum(role.memory_bytes for role in pool.roles if role.engine != "vLLM")
                   for pool in plan.pools)
    free = psutil.virtual_memory().available
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    waiting = (f"Megatron state offloaded per node <= {per_node / memory.GIB:.2f} GiB" if platform.has_cuda()
               else "nothing offloaded on CPU")
    if not platform.has_cuda():
        per_node = 0
    figure = f"{waiting}; host memory free {free / memory.GIB:.1f} GiB, /dev/shm free {shm / memory.GIB:.1f} GiB"
    if per_node > free:
        return Result("host memory", FAIL, figure, "nodes with more memory, or actor.offload=false / "
                      "ref.param_offload=false (the state then stays on the GPUs), or more GPUs to shard it")
    if shm < 1 << 30:
        return Result("host memory", FAIL, figure, "give /dev/shm at least 1 GiB (docker run --shm-size=16g)")
    return Result("host memory", PASS, figure)


def gpu_memory(cfg: Config) -> Result:
    """The dry-run memory plan per GPU against this machine's GPUs."""
    if not platform.has_cuda():
        return Result("GPU memory", SKIP, "no CUDA: the plan's per-GPU figures apply to GPUs")
    total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    plan = build_plan(cfg, gpu_memory_gib=total / memory.GIB, refuse_over_memory=False)  # a FAIL, not a crash
    worst = max(plan.pools, key=lambda pool: pool.memory_bytes)
    phase = f" in {worst.peak.name}, its peak phase," if len(worst.phases) > 1 else ""
    figure = (f"the {worst.name} pool needs ~{worst.memory_bytes / memory.GIB:.1f} GiB per GPU{phase} with "
              f"activations, of {total / memory.GIB:.1f} GiB")
    if plan.warnings:
        return Result("GPU memory", FAIL, figure, "; ".join(plan.warnings))
    return Result("GPU memory", PASS, figure)
