"""Weights to rollout engines on workers of their own (rollout.placement=separate).

The policy's HF tensors are assembled on the actor's rank 0 one bucket at a time, straight into the buffer that
is then broadcast over a process group of that rank and every engine worker (NCCL on GPU, gloo on CPU): the
sender holds one bucket of them (the largest tensor when it is bigger), plus the resharder's transfer buckets of
what other actor ranks send it, never the whole model. Each engine worker writes into its parameters the HF
regions it keeps (the engine's `sync_targets`: the same map the colocated sync and `engine_mismatches` use, so
both placements give engines the same bits).

The group is a process group of its own (its own store), beside each side's default group: the actor's ranks
and the engines' ranks each already form a world for Megatron and for the engines' tensor parallelism.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from rl_megatron import platform
from rl_megatron.models.weight_layouts import hf_view, local_view
from rl_megatron.platform.debugger import collective_timeout
from rl_megatron.resharding import Resharder
from rl_megatron.resharding.specs import Held, hf_shapes, hf_target

SENDER = 0  # the actor's rank 0 is rank 0 of the weight group; engine worker r is rank 1 + r
TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in bytes, within its bucket

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def bucket_manifest(shapes: dict[str, tuple[tuple, torch.dtype]], bucket_bytes: int) -> list[list[Entry]]:
    """The HF tensors (name -> shape, dtype), in name order, packed into buckets of at most `bucket_bytes` (a
    larger tensor travels alone); offsets are 16-byte aligned so that every tensor can be viewed in its dtype."""
    buckets, current, used = [], [], 0
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        size = -(-torch.Size(shape).numel() * dtype.itemsize // 16) * 16
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(Entry(name, tuple(shape), dtype, used))
        used += size
    return buckets + ([current] if current else [])


def _end(bucket: list[Entry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def _view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    return buffer[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)


def weight_group(host: str, port: int, rank: int, size: int):
    """This process's member of the weight group, meeting at the store listening at host:port (started on the
    sender's side: `workers.distributed.listen_store`)."""
    timeout = collective_timeout(TIMEOUT)  # a day with Ray's debugger on: a member may be paused at a breakpoint
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if platform.has_cuda():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # as gloo's: a first sync of a large model may wait on a slow gather
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def leave_weight_group(group) -> None:
    """Free the group's communicator (NCCL holds device memory and threads until it is shut down)."""
    if group is not None:
        group.shutdown()


def _broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = SENDER
    group.broadcast([buffer], options).wait()


def _broadcast_manifest(group, manifest: list[list[Entry]] | None) -> list[list[Entry]]:
    """The sender's manifest on every member (pickled: a length, then the bytes)."""
    device = platform.device()
    data = pickle.dumps(manifest) if manifest is not None else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _broadcast(group, length)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if manifest is not None
              else torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    _broadcast(group, buffer)
    return manifest if manifest is not None else pickle.loads(buffer.cpu().numpy().tobytes())


class BroadcastSender:
    """The actor's side of separate-engine syncs, made once on every actor rank (a collective, as is `send`).

    A `Resharder` from the actor's shards to full HF tensors on rank 0, in one phase per broadcast bucket, whose
    targets on rank 0 are views into one bucket buffer: each phase assembles a bucket, which rank 0 broadcasts
    before the next phase reuses the buffer."""

    def __init__(self, sources: Held, source_errors: list[str], group, bucket_bytes: int):
        self.group = group  # the weight group on the actor's rank 0, None on its other ranks
        self.bucket_bytes = bucket_bytes
        self.manifest: list[list[Entry]] = []
        self.bucket_of: dict[str, int] = {}
        self.buffer = None
        self.resharder = Resharder(sources, source_errors, self._targets, bucket_bytes,
                                   phase_of=lambda name: self.bucket_of[name])

    def _targets(self, source_specs: list) -> Held:
        """Called by the resharder on every rank with every rank's shards: the manifest, and rank 0's targets."""
        self.manifest = bucket_manifest(hf_shapes(source_specs), self.bucket_bytes)
        self.bucket_of = {entry.name: i for i, bucket in enumerate(self.manifest) for entry in bucket}
        if self.group is None:
            return {}
        self.buffer = torch.empty(max(map(_end, self.manifest)), dtype=torch.uint8, device=platform.device())
        return {e.name: hf_target(e.name, _view(self.buffer, e)) for bucket in self.manifest for e in bucket}

    def send(self) -> None:
        """One sync: a collective over the actor's ranks (each bucket's gather); rank 0 broadcasts the buckets."""
        if self.group is not None:
            _broadcast_manifest(self.group, self.manifest)
        for i, bucket in enumerate(self.manifest):
            self.resharder.sync(phase=i)
            if self.group is not None:
                _broadcast(self.group, self.buffer[:_end(bucket)])

    def close(self) -> None:
        self.resharder.close()
        leave_weight_group(self.group)


def receive_weights(group) -> Iterator[dict[str, torch.Tensor]]:
    """An engine worker's side of a sync: the tensors of each bucket by HF name, valid until the next."""
    manifest = _broadcast_manifest(group, None)
    buffer = torch.empty(max(map(_end, manifest), default=0), dtype=torch.uint8, device=platform.device())
    for bucket in manifest:
        _broadcast(group, buffer[:_end(bucket)])
        yield {entry.name: _view(buffer, entry) for entry in bucket}


def write_engine_regions(targets: Held, tensors: dict[str, torch.Tensor]) -> int:
    """Copy into the engine's parameters (`targets`: its `sync_targets`) the regions of `tensors` (HF name -> full
    tensor) they keep; returns the bytes written."""
    written = 0
    for tensor, spec in targets.values():
        for region in spec.regions:
            source = tensors.get(region.hf_name)
            if source is not None:
                local_view(tensor, region).copy_(hf_view(source, region))
                written += local_view(tensor, region).nbytes
    return written
