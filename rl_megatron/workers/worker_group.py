"""Ray worker groups: one actor per device, placed node by node (see ResourcePool), and one dispatch mechanism.

A worker method declares how the controller's batch reaches the ranks and how results come back, and the phase
it needs (see `workers/phases.py`; the worker's `enter(phase)` / `leave(phase)` run around the call, in a range
named by the phase for profilers, `workers/profiling.py`):

    @dispatch(axis="dp", phase=forward(Role.ACTOR))  # split the positional arguments (a TrainBatch, a list) by
    def log_probs(self, batch)                       # data-parallel rank, TP/PP peers get the same slice, keyword
                                                     # arguments go to all; collect (concatenated, in DP order)
                                                     # from the ranks that own the result

    @dispatch(axis=None)        # every rank gets the same arguments; all results come back as a list

An axis names a (shard, num_shards, owns_output) triple that each worker reports in `mesh()`:
"dp" for Megatron's data parallelism, "rollout" for the rollout engines.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_megatron.batch import RowTensors
from rl_megatron.workers.cluster import ClusterError, describe_cluster, device_resource, groups_that_fit
from rl_megatron.workers.debugging import controller_wait_s
from rl_megatron.workers.failures import (WorkerDied, WorkerPlacement, describe_death, describe_raise, oom_kills,
                                          where_am_i)
from rl_megatron.workers.phases import Phase
from rl_megatron.workers.profiling import phase_range

logger = logging.getLogger(__name__)


def dispatch(axis: str | None, phase: Phase | None = None) -> Callable:
    def mark(method):
        if phase is None:
            dispatched = method
        else:
            @functools.wraps(method)
            def dispatched(worker, *args, **kwargs):
                with phase_range(phase):  # the moves into and out of the phase count as its time
                    worker.enter(phase)
                    result = method(worker, *args, **kwargs)
                    worker.leave(phase)
                return result
        dispatched.dispatch_axis = axis
        return dispatched

    return mark


def split_batch(batch: Any, parts: int) -> list:
    """Split a batch of tensors (or a list) into `parts` equal, contiguous slices."""
    if isinstance(batch, RowTensors):
        return batch.split(parts)
    if len(batch) % parts:
        raise ValueError(f"A batch of {len(batch)} items does not split into {parts} equal parts.")
    size = len(batch) // parts
    return [batch[i * size:(i + 1) * size] for i in range(parts)]


def concat_batches(parts: list) -> Any:
    if isinstance(parts[0], RowTensors):
        return type(parts[0]).cat(parts)
    if isinstance(parts[0], list):
        return [item for part in parts for item in part]
    return parts


class ResourcePool:
    """`nnodes` x `devices_per_node` devices for one worker group: one STRICT_PACK placement group per node, one
    bundle per device (a GPU, or a CPU slot when the cluster has no GPU).

    Rank r runs on pool node r // devices_per_node, bundle r % devices_per_node. Megatron orders ranks TP first
    (then CP, DP/EP, PP), so with TP x CP dividing devices_per_node a TP group never crosses nodes, and pipeline
    stages follow the pool's node order. (A single PACK group may split its bundles over nodes in any order.)
    Two pool nodes may share one physical node when it has room for both; TP groups still stay within one."""

    def __init__(self, nnodes: int, devices_per_node: int, cpus_per_device: int = 1, *,
                 ready_timeout_s: float = 120.0,
                 config_keys: tuple[str, str] = ("trainer.nnodes", "trainer.n_gpus_per_node")):
        self.nnodes, self.devices_per_node = nnodes, devices_per_node
        self.world_size = nnodes * devices_per_node
        self.resource = device_resource()
        bundle = {"CPU": cpus_per_device, **({"GPU": 1} if self.resource == "GPU" else {})}
        self.bundle = bundle
        self.node_groups = [placement_group([dict(bundle) for _ in range(devices_per_node)], strategy="STRICT_PACK")
                            for _ in range(nnodes)]
        self._wait_until_placed(ready_timeout_s, config_keys)

    def _wait_until_placed(self, timeout_s: float, config_keys: tuple[str, str]) -> None:
        per_node = self.devices_per_node * (1 if self.resource == "GPU" else self.bundle["CPU"])
        asks = (f"{config_keys[0]}={self.nnodes} x {config_keys[1]}={self.devices_per_node} asks for "
                f"{self.nnodes} node(s) with {per_node} free {self.resource} each")
        if groups_that_fit(per_node, self.resource) < self.nnodes:
            # An autoscaling cluster may still add nodes: say what is missing, then wait.
            logger.warning("%s; waiting up to %g s for them. %s", asks, timeout_s, describe_cluster(self.resource))
        try:
            ray.get([group.ready() for group in self.node_groups], timeout=timeout_s)
        except GetTimeoutError:
            self.release()  # a pending group would take the devices later, when nobody uses them
            raise ClusterError(
                f"{asks}, but Ray did not place them within {timeout_s:g} s. {describe_cluster(self.resource)} Add "
                f"nodes to the cluster (`ray start --address=<head>` on each), free devices other jobs hold, or lower "
                f"{config_keys[0]} / {config_keys[1]}.") from None

    def node_of(self, rank: int) -> int:
        """The pool node (placement group) that hosts `rank`."""
        return rank // self.devices_per_node

    def options(self, rank: int) -> dict:
        return {
            "num_cpus": self.bundle["CPU"],
            "num_gpus": self.bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.node_groups[self.node_of(rank)],
                placement_group_bundle_index=rank % self.devices_per_node),
        }

    def release(self) -> None:
        for group in self.node_groups:
            remove_placement_group(group)


def describe_placement(placement: list[WorkerPlacement]) -> str:
    """E.g. "node 0 = 10.0.0.5 (node 1f6d5c12): ranks 0-3; node 1 = 10.0.0.6 (node e4a7795d): ranks 4-7"."""
    by_node: dict[int, list[WorkerPlacement]] = {}
    for where in placement:
        by_node.setdefault(where.pool_node, []).append(where)
    return "; ".join(f"node {index} = {ranks[0].node_ip} (node {ranks[0].node_id[:8]}): ranks "
                     f"{ranks[0].rank}-{ranks[-1].rank}" for index, ranks in sorted(by_node.items()))


class WorkerGroup:
    """N actors of `worker_cls`; each method marked with @dispatch becomes a method of the group.

    A worker class takes (rank, world_size, *args) and provides `rendezvous()` (on rank 0: the address of a store
    it starts and holds for a group it leads, `distributed.rendezvous_address`), `init(addr, port)`, `mesh()` (its
    place on each dispatch axis) and `close()`. `placement` says which node each rank runs on (also logged at INFO,
    with the list as the record's `placement` attribute). `name` (e.g. the roles it hosts) names the group when one
    of its workers dies (`WorkerDied`). With `start=False` the workers are launched and `wait_started` waits for
    them: several groups launched before any is waited for start side by side (a run's pools)."""

    def __init__(self, worker_cls: type, pool: ResourcePool, *args, env: dict | None = None, name: str = "",
                 start: bool = True):
        remote_cls = ray.remote(worker_cls)
        self.worker_cls, self.pool, self.name = worker_cls, pool, name or worker_cls.__name__
        self.oom_kills_before = oom_kills()  # the kernel's count on this node, to tell an OOM kill later
        self.placement: list[WorkerPlacement] = []  # known once the workers report it (`wait_started`)
        runtime_env = {"env_vars": env or {}}
        self.workers = [remote_cls.options(**pool.options(rank), runtime_env=runtime_env)
                        .remote(rank, pool.world_size, *args) for rank in range(pool.world_size)]
        if start:
            self.wait_started()

    def wait_started(self) -> "WorkerGroup":
        """Wait until every worker is built (where it runs is logged), then join them in their process group and
        learn their places on the dispatch axes; the group's dispatched methods exist from then on."""
        self.placement = [WorkerPlacement(rank, self.pool.node_of(rank), *where) for rank, where in
                          enumerate(self.get([w.__ray_call__.remote(where_am_i) for w in self.workers]))]
        logger.info("%s placement: %s", self.worker_cls.__name__, describe_placement(self.placement),
                    extra={"placement": self.placement})
        addr, port = self.rank0_address()  # rank 0 hosts the process group's store
        self.get([w.init.remote(addr, port) for w in self.workers])
        self.meshes = self.get([w.mesh.remote() for w in self.workers])
        for name in dir(self.worker_cls):
            method = getattr(self.worker_cls, name)
            if hasattr(method, "dispatch_axis"):
                setattr(self, name, functools.partial(self._call, name, method.dispatch_axis))
        return self

    def rank0_address(self) -> tuple[str, int]:
        """Where rank 0's store listens (where a process group led by rank 0 meets)."""
        return self.get(self.workers[0].rendezvous.remote())

    def get(self, refs):
        """`ray.get(refs)` of this group's calls; a dead worker raises WorkerDied, saying which and why. (When one
        worker dies, its peers' calls may fail first, e.g. a collective losing a member: the dead one is looked
        for whatever the error.)"""
        try:
            return ray.get(refs)
        except RayError as err:
            dead = self._dead_worker(refs if isinstance(refs, list) else [refs])
            if dead is None:
                self._note_origin(err)
                raise
            raise WorkerDied(dead) from None

    def _note_origin(self, err: RayError) -> None:
        """An exception a worker raised (Ray's RayTaskError, an instance of the original exception's class too)
        gets a note naming the worker and quoting the end of its log, shown under the traceback."""
        if isinstance(err, RayTaskError) and self.placement:
            where = describe_raise(self.name, self.pool.world_size, self.placement, str(err),
                                   ray.get_runtime_context().get_node_id())
            if where is not None:
                err.add_note(where)

    def _dead_worker(self, calls: list, wait_s: float = 5.0) -> str | None:
        """The report of the first worker (by rank) found dead, or None if all answer or are busy. The peers' failed
        `calls` are collected too: Ray would print each one's traceback after the report."""
        pings = [w.__ray_call__.remote(lambda worker: None) for w in self.workers]
        # Live workers busy in a broken call stay pending; a dead one answers at once.
        ray.wait(pings + calls, num_returns=len(pings + calls), timeout=wait_s)
        for call in calls:
            try:
                ray.get(call, timeout=0)
            except RayError:
                pass
        here = ray.get_runtime_context().get_node_id()
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=0)
            except GetTimeoutError:
                continue
            # Ray's word on the cause comes with every call to a dead actor (OutOfMemoryError: its memory monitor
            # killed the worker while it was being created).
            except (RayActorError, OutOfMemoryError) as death:
                where = self.placement[rank] if self.placement else None
                return describe_death(self.name, rank, self.pool.world_size, where,
                                      getattr(death, "error_msg", None) or str(death), here, self.oom_kills_before)
        return None

    def call_async(self, name: str, *args, **kwargs) -> list:
        """Start method `name` on every worker with the same arguments; returns the Ray object refs (for calls
        that must run while another group takes part in the same collective)."""
        return [getattr(w, name).remote(*args, **kwargs) for w in self.workers]

    async def call_shard(self, name: str, axis: str, shard: int, *args, **kwargs):
        """Method `name` on the workers of one shard of `axis` only (one rollout engine's TP ranks), awaited in the
        controller's event loop; the result of the worker that owns it. Other shards go on meanwhile."""
        ranks = [rank for rank, mesh in enumerate(self.meshes) if mesh[axis][0] == shard]
        refs = [getattr(self.workers[rank], name).remote(*args, **kwargs) for rank in ranks]
        try:
            results = await asyncio.gather(*refs)
        except RayError as err:
            dead = self._dead_worker(refs)
            if dead is None:
                self._note_origin(err)
                raise
            raise WorkerDied(dead) from None
        return next(out for rank, out in zip(ranks, results) if self.meshes[rank][axis][2])

    def _call(self, name: str, axis: str | None, *args, **kwargs):
        if axis is None:
            return self.get(self.call_async(name, *args, **kwargs))
        shards = self.meshes[0][axis][1]
        inputs = [split_batch(a, shards) for a in args]
        refs = [getattr(w, name).remote(*(part[mesh[axis][0]] for part in inputs), **kwargs)
                for w, mesh in zip(self.workers, self.meshes)]
        results = self.get(refs)
        owned = sorted((mesh[axis][0], out) for mesh, out in zip(self.meshes, results) if mesh[axis][2])
        return concat_batches([out for _, out in owned])

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.shutdown(after_error=exc_type is not None)

    def shutdown(self, after_error: bool = False) -> None:
        """Let the workers release what outlives a process (shared memory), stop them, free their devices: within
        120 s (without limit while Ray's debugger is on: a `close` waits behind a method paused at a breakpoint).
        After an error, live workers may be stuck in a collective with a failed peer: they get 10 s, also with the
        debugger on (its collectives would wait a day), and what their `close` raises is not reported over the
        error."""
        closing = [worker.close.remote() for worker in self.workers]
        if after_error:
            ray.wait(closing, num_returns=len(closing), timeout=10)
        else:
            ray.get(closing, timeout=controller_wait_s(120))
        for worker in self.workers:
            ray.kill(worker)
        self.pool.release()
