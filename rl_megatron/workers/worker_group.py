"""Ray worker groups: one actor per device, placed with a placement group, and one dispatch mechanism.

A worker method declares how the controller's batch reaches the ranks and how results come back:

    @dispatch(axis="dp")        # split the batch by data-parallel rank; TP/PP peers get the same slice;
    def log_probs(self, batch)  # collect (concatenated, in DP order) from the ranks that own the result

    @dispatch(axis=None)        # every rank gets the same arguments; all results come back as a list

An axis names a (shard, num_shards, owns_output) triple that each worker reports in `mesh()`:
"dp" for Megatron's data parallelism, "rollout" for the rollout engines.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_megatron import platform


def dispatch(axis: str | None) -> Callable:
    def mark(method):
        method.dispatch_axis = axis
        return method

    return mark


def split_batch(batch: Any, parts: int) -> list:
    """Split a dict of tensors (or a list) into `parts` equal, contiguous slices."""
    if isinstance(batch, dict):
        count = next(iter(batch.values())).shape[0]
        if count % parts:
            raise ValueError(f"A batch of {count} samples does not split into {parts} equal parts.")
        chunks = {k: torch.chunk(v, parts) for k, v in batch.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]
    if len(batch) % parts:
        raise ValueError(f"A batch of {len(batch)} items does not split into {parts} equal parts.")
    size = len(batch) // parts
    return [batch[i * size:(i + 1) * size] for i in range(parts)]


def concat_batches(parts: list) -> Any:
    if isinstance(parts[0], dict) and all(isinstance(v, torch.Tensor) for v in parts[0].values()):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if isinstance(parts[0], list):
        return [item for part in parts for item in part]
    return parts


class ResourcePool:
    """A placement group with one bundle per device, packed per node (CPU slots when there is no GPU)."""

    def __init__(self, nnodes: int, devices_per_node: int, cpus_per_device: int = 1):
        self.world_size = nnodes * devices_per_node
        bundle = {"CPU": cpus_per_device, **({"GPU": 1} if platform.has_cuda() else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=120)
        self.bundle = bundle

    def options(self, index: int) -> dict:
        return {
            "num_cpus": self.bundle["CPU"],
            "num_gpus": self.bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index),
        }


class WorkerGroup:
    """N actors of `worker_cls`; each method marked with @dispatch becomes a method of the group.

    A worker class takes (rank, world_size, *args) and provides `rendezvous()` (rank 0's address and a free
    port), `init(addr, port)`, `mesh()` (its place on each dispatch axis) and `close()`."""

    def __init__(self, worker_cls: type, pool: ResourcePool, *args, env: dict | None = None):
        remote_cls = ray.remote(worker_cls)
        self.pool = pool
        runtime_env = {"env_vars": env or {}}
        self.workers = [remote_cls.options(**pool.options(rank), runtime_env=runtime_env)
                        .remote(rank, pool.world_size, *args) for rank in range(pool.world_size)]
        addr, port = ray.get(self.workers[0].rendezvous.remote())  # rank 0 hosts the process group's store
        ray.get([w.init.remote(addr, port) for w in self.workers])
        self.meshes = ray.get([w.mesh.remote() for w in self.workers])
        for name in dir(worker_cls):
            method = getattr(worker_cls, name)
            if hasattr(method, "dispatch_axis"):
                setattr(self, name, functools.partial(self._call, name, method.dispatch_axis))

    def _call(self, name: str, axis: str | None, *args):
        if axis is None:
            return ray.get([getattr(w, name).remote(*args) for w in self.workers])
        shards = self.meshes[0][axis][1]
        inputs = [split_batch(a, shards) for a in args]
        refs = [getattr(w, name).remote(*(part[mesh[axis][0]] for part in inputs))
                for w, mesh in zip(self.workers, self.meshes)]
        results = ray.get(refs)
        owned = sorted((mesh[axis][0], out) for mesh, out in zip(self.meshes, results) if mesh[axis][2])
        return concat_batches([out for _, out in owned])

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Let the workers release what outlives a process (shared memory), stop them, free their devices."""
        ray.get([worker.close.remote() for worker in self.workers], timeout=120)
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.pool.placement_group)
