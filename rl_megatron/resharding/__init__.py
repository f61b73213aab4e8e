"""Resharding: Megatron TP/PP/VPP shards -> the rollout engine's layout (or full HF tensors), exactly, within
a memory bound, at close to copy bandwidth.

`Resharder` is built once per (source layout, target layout). It gathers from every rank what it holds and
what it must be given (as HF regions, see `plan.py`), builds the plan on every rank and validates it before
any byte moves; `sync()` then copies in place what this rank can address (its own shards, and with
`channel="auto"` the shared parameters of peers on its machine, see `shared_params.py`) and sends the rest in
buckets over a channel (`channels.py`). Extra memory at any time: at most `bucket_bytes` per rank.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from rl_megatron.models.weight_layouts import hf_view, local_view
from rl_megatron.resharding.channels import make_channel
from rl_megatron.resharding.plan import Plan, PlanError, build_plan
from rl_megatron.resharding.shared_params import PeerReads, peer_tensor, share_parameters
from rl_megatron.resharding.specs import Held, hf_targets, megatron_sources

__all__ = ["PlanError", "Resharder", "SyncStats", "engine_mismatches", "export_hf_state_dict",
           "megatron_sources", "share_parameters"]


@dataclass
class SyncStats:
    bytes_in_place: int  # copied by this rank from its own shards or a peer's shared parameters
    bytes_received: int  # written on this rank from other ranks' buckets
    seconds_in_place: float  # copying those (not waiting for peers)
    seconds: float  # the whole sync on this rank


def checksum(tensor: torch.Tensor) -> int:
    """Exact and position-sensitive: the raw bits of every element, weighted by position."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    flat = tensor.contiguous().view(bits).reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 8191 + 1
    return int((flat * weights).sum())


class Resharder:
    """Moves this rank's `sources` into the `targets` of every rank (all ranks of the default group take part).

    `targets` is either this rank's target tensors or a function of every rank's source specs that returns
    them (a full HF export needs to know what the other stages hold). With `phase_of` (target key -> phase
    number, the same on every rank), `sync(phase)` fills one phase's targets at a time."""

    def __init__(self, sources: Held, source_errors: list[str], targets: Held | Callable[[list], Held],
                 bucket_bytes: int, channel: str = "auto", verify: bool = False,
                 phase_of: Callable[[str], int] | None = None):
        self.rank = dist.get_rank()
        self.sources, self.verify_after_sync = sources, verify
        self.device = next((t.device for t, _ in sources.values()), torch.device("cpu"))
        all_sources = self._gather(([spec for _, spec in sources.values()], source_errors, socket.gethostname()))
        errors = [e for _, errs, _ in all_sources for e in errs]
        source_specs = [specs for specs, _, _ in all_sources]
        hosts = [host for _, _, host in all_sources]
        # auto: pieces of a peer's shared parameters are read in place; what is left travels in buckets, through
        # shared memory between CPU ranks of one machine, over the process group (NCCL) otherwise.
        read_in_place = channel == "auto"
        if channel == "auto":
            channel = "shared_memory" if len(set(hosts)) == 1 and self.device.type == "cpu" else "process_group"
        self.targets = targets(source_specs) if callable(targets) else targets
        target_specs = self._gather([spec for _, spec in self.targets.values()])
        if errors:  # every rank raises the same error, so none is left waiting in a collective
            raise PlanError("Resharding plan: " + "; ".join(dict.fromkeys(errors)))
        self.channel_name = channel
        self.channel = make_channel(channel, self.device, bucket_bytes)
        self.plan: Plan = build_plan(source_specs, target_specs, bucket_bytes // self.channel.slots, hosts,
                                     phase_of, read_peers=read_in_place)
        # Peers' shared parameters this rank reads in place, mapped now (their files exist while they live).
        specs_by_rank = [{spec.key: spec for spec in specs} for specs in source_specs]
        self.peer_sources = {}
        for piece in self.plan.local.get(self.rank, []):
            if piece.src_rank != self.rank and (piece.src_rank, piece.src_key) not in self.peer_sources:
                spec = specs_by_rank[piece.src_rank][piece.src_key]
                self.peer_sources[(piece.src_rank, piece.src_key)] = peer_tensor(spec.location, spec.dtype, spec.shape)
        self.channel.connect({b.dst_rank for b in self.plan.buckets if b.src_rank == self.rank},
                             {b.src_rank for b in self.plan.buckets if b.dst_rank == self.rank})
        # The handshakes of reading peers' parameters in place (each rank creates its counters, maps its peers').
        self.peer_reads = None
        if self.plan.reads_peers:
            local = self.plan.local
            self.peer_reads = PeerReads({p.src_rank for p in local.get(self.rank, []) if p.src_rank != self.rank},
                                        {rank for rank, pieces in local.items() for p in pieces
                                         if p.src_rank == self.rank and rank != self.rank})
            self.peer_reads.connect(self._gather(self.peer_reads.own.handle))
            dist.barrier()
            self.peer_reads.own.unlink()
        # The in-place copies' views (target views, source views) by (phase, part), made at the first sync and kept
        # while no source or target tensor moved (`_addresses`).
        self._views: dict[tuple, tuple[list, list]] = {}
        self._views_at: tuple = ()

    @staticmethod
    def _gather(obj) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _source(self, key: str, rank: int | None = None) -> torch.Tensor:
        if rank is None or rank == self.rank:
            return self.sources[key][0]
        return self.peer_sources[(rank, key)]

    def _target(self, key: str) -> torch.Tensor:
        return self.targets[key][0]

    @torch.no_grad()
    def sync(self, phase: int | None = None) -> SyncStats:
        """Fill the targets: every phase of the plan in order, or only `phase` (a collective either way).

        Reading peers' parameters in place takes two handshakes (`PeerReads`): a rank reads a peer's shards once the
        peer's parameters are final for this sync, after copying its own; and it returns once every rank reading its
        shards is done, so that its caller may change them."""
        start = time.perf_counter()
        addresses = self._addresses()
        if addresses != self._views_at:
            self._views.clear()
            self._views_at = addresses
        phases = self.plan.phases if phase is None else [self.plan.phases[phase]]
        reads = self.peer_reads
        if reads is not None:
            reads.ready()
        copied, copy_seconds, received = 0, 0.0, 0
        for current in phases:
            local = current.local.get(self.rank, [])
            for i, round_ in enumerate(current.rounds or [[]]):
                outgoing = next((b for b in round_ if b.src_rank == self.rank), None)
                incoming = next((b for b in round_ if b.dst_rank == self.rank), None)
                if outgoing is not None:
                    self._pack(outgoing)
                self.channel.start_round(None if outgoing is None else outgoing.dst_rank,
                                         None if incoming is None else (incoming.src_rank, incoming.nbytes))
                if i == 0:  # while the first buckets travel
                    copy_start = time.perf_counter()
                    self._copy((id(current), "own"), [p for p in local if p.src_rank == self.rank])
                    peers = [p for p in local if p.src_rank != self.rank]
                    if peers:
                        waited = time.perf_counter()
                        reads.wait_for_sources()
                        copy_start += time.perf_counter() - waited
                        self._copy((id(current), "peers"), peers)
                    copied += sum(p.nbytes for p in local)
                    copy_seconds += time.perf_counter() - copy_start
                if incoming is not None:
                    self._unpack(incoming)
                    received += incoming.nbytes
                self.channel.end_round()
        if reads is not None:
            reads.done()
        self.channel.finish()
        if reads is not None:
            reads.wait_for_readers()
        stats = SyncStats(copied, received, copy_seconds, time.perf_counter() - start)
        if self.verify_after_sync:
            self.verify()
        return stats

    def _copy(self, part: tuple, pieces: list) -> None:
        """`pieces` copied in one call. A sync copies hundreds of pieces; making each one's two views at every sync
        cost more than its bytes on CPU, so they are made once per `part` of the plan."""
        if not pieces:
            return
        views = self._views.get(part)
        if views is None:
            views = self._views[part] = ([local_view(self._target(p.dst_key), p.dst) for p in pieces],
                                         [local_view(self._source(p.src_key, p.src_rank), p.src) for p in pieces])
        torch._foreach_copy_(*views)

    def _addresses(self) -> tuple:
        """Where every source and target tensor's memory is. A tensor given other memory (`param.data = ...`, or its
        storage reallocated) since the views were made: they are made again."""
        return tuple(t.data_ptr() for held in (self.sources, self.targets) for t, _ in held.values())

    # Packing and unpacking hold no reference to a bucket once done, so that the channel alone decides how many
    # buckets are alive (its `slots`).
    def _pack(self, bucket) -> None:
        buffer = self.channel.buffer_for(bucket.dst_rank, bucket.nbytes)
        for piece, offset in zip(bucket.pieces, bucket.offsets):
            _window(buffer, offset, piece).copy_(local_view(self._source(piece.src_key), piece.src))

    def _unpack(self, bucket) -> None:
        buffer = self.channel.received()
        for piece, offset in zip(bucket.pieces, bucket.offsets):
            local_view(self._target(piece.dst_key), piece.dst).copy_(_window(buffer, offset, piece))
        self.channel.release(bucket.src_rank)

    def close(self) -> None:
        self.channel.close()

    @torch.no_grad()
    def verify(self) -> None:
        """Compare checksums of every piece as read on its source rank and as written on its target rank; raise
        on every rank, naming the HF tensor, if any differs."""
        pieces = [p for ps in self.plan.local.values() for p in ps] + [p for b in self.plan.buckets for p in b.pieces]
        mine = {}
        for i, piece in enumerate(pieces):
            if piece.src_rank == self.rank:
                mine[("src", i)] = checksum(local_view(self._source(piece.src_key), piece.src))
            if piece.dst_rank == self.rank:
                mine[("dst", i)] = checksum(local_view(self._target(piece.dst_key), piece.dst))
        sums = {k: v for part in self._gather(mine) for k, v in part.items()}
        bad = [pieces[i] for i in range(len(pieces)) if sums[("src", i)] != sums[("dst", i)]]
        if bad:
            p = bad[0]
            box = ", ".join(f"{a}:{b}" for a, b in zip(p.src.start, p.src.stop))
            raise RuntimeError(f"Weight sync check failed for {len(bad)} piece(s); first: '{p.src.hf_name}'[{box}] "
                               f"from '{p.src_key}' (rank {p.src_rank}) into '{p.dst_key}' (rank {p.dst_rank}).")


def _window(buffer: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """The bytes of one piece in a bucket, as the source's dtype, in the piece's shape."""
    shape = tuple(b - a for a, b in zip(piece.src.start, piece.src.stop))
    return buffer[offset:offset + piece.nbytes].view(piece.dtype).view(shape)


def export_hf_state_dict(chunks: list, table, dst: int = 0, bucket_bytes: int = 64 << 20,
                         substitutes: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full HF state dict of the model whose local shards are `chunks`, on rank `dst` (empty elsewhere).
    A collective over every rank. `substitutes`: as for `megatron_sources` (a LoRA model's merged weights)."""
    sources, errors = megatron_sources(chunks, table, substitutes)
    rank = dist.get_rank()
    resharder = Resharder(sources, errors, lambda specs: hf_targets(specs) if rank == dst else {}, bucket_bytes)
    try:
        resharder.sync()
    finally:
        resharder.close()
    return {name: tensor for name, (tensor, _) in resharder.targets.items()}


def engine_mismatches(targets: Held, hf_state: dict[str, torch.Tensor]) -> list[str]:
    """The engine's parameters on this rank (`targets`: its `sync_targets`) whose HF regions differ from `hf_state`,
    bit for bit."""
    bad = []
    for name, (tensor, spec) in targets.items():
        for region in spec.regions:
            expected = hf_state.get(region.hf_name)
            if expected is None or not torch.equal(local_view(tensor, region), hf_view(expected, region)):
                bad.append(f"{name} <- {region.hf_name}")
    return bad
