"""Weights to rollout engines on workers of their own (rollout.placement=separate).

The policy's full HF tensors are gathered on the actor's rank 0 (`export_hf_state_dict`) and broadcast in
buckets over a process group of that rank and every engine worker (NCCL on GPU, gloo on CPU); each engine
worker writes into its parameters the HF regions it keeps (`vllm_targets`: the same map the colocated sync and
`engine_mismatches` use, so both placements give engines the same bits).

The group is a process group of its own (its own store), beside each side's default group: the actor's ranks
and the engines' ranks each already form a world for Megatron and for vLLM's tensor parallelism.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from rl_megatron import platform
from rl_megatron.models.weight_tables import hf_view, local_view

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


def bucket_manifest(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[Entry]]:
    """The HF tensors, in name order, packed into buckets of at most `bucket_bytes` (a larger tensor travels
    alone); offsets are 16-byte aligned so that every tensor can be viewed in its dtype."""
    buckets, current, used = [], [], 0
    for name in sorted(tensors):
        tensor = tensors[name]
        size = -(-tensor.numel() * tensor.element_size() // 16) * 16
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(Entry(name, tuple(tensor.shape), tensor.dtype, used))
        used += size
    return buckets + ([current] if current else [])


def weight_group(host: str, port: int, rank: int, size: int):
    """This process's member of the weight group (rank 0 hosts its store at host:port)."""
    store = dist.TCPStore(host, port, size, rank == SENDER, timeout=TIMEOUT)
    if platform.has_cuda():
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)


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


def _buckets(group, manifest: list[list[Entry]], state: dict | None) -> Iterator[dict[str, torch.Tensor]]:
    device = platform.device()
    for bucket in manifest:
        last = bucket[-1]
        buffer = torch.empty(last.offset + last.nbytes, dtype=torch.uint8, device=device)
        views = {e.name: buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in bucket}
        if state is not None:
            for name, view in views.items():
                view.copy_(state[name])
        _broadcast(group, buffer)
        yield views


def send_weights(group, state: dict[str, torch.Tensor], bucket_bytes: int) -> None:
    """The sender's side of a sync: `state` (full HF tensors) to every engine worker, in buckets."""
    for _ in _buckets(group, _broadcast_manifest(group, bucket_manifest(state, bucket_bytes)), state):
        pass


def receive_weights(group) -> Iterator[dict[str, torch.Tensor]]:
    """An engine worker's side of a sync: the tensors of each bucket by HF name, valid until the next."""
    yield from _buckets(group, _broadcast_manifest(group, None), None)


def write_engine_regions(targets: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Copy into the engine's parameters (`vllm_targets`) the regions of `tensors` (HF name -> full tensor)
    they keep; returns the bytes written."""
    written = 0
    for tensor, spec in targets.values():
        for region in spec.regions:
            source = tensors.get(region.hf_name)
            if source is not None:
                local_view(tensor, region).copy_(hf_view(source, region))
                written += local_view(tensor, region).nbytes
    return written
