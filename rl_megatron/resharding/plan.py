"""The transfer plan: which bytes of which source shard go into which target tensor, on which rank.

Sources (Megatron shards) and targets (an engine's parameters, or full HF tensors) each describe what they hold
as `Region`s of HF tensors. The plan intersects them: every part of a target region is taken from a source
on the same rank when one holds it (a direct copy: shard-to-shard, no gather), otherwise from the least
loaded rank that does, packed with other parts going the same way into buckets of at most `bucket_bytes`,
scheduled in rounds.
Computed once per (source layout, target layout), identically on every rank, and checked before any byte moves.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from rl_megatron.models.weight_layouts import Region, Shape

ALIGN = 64  # bytes: every piece in a bucket (every parameter in a shared file) starts aligned for any dtype


class PlanError(ValueError):
    """The source and target layouts do not fit together; raised on every rank before anything is copied."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor one rank holds (a Megatron shard or an engine parameter) and the HF regions it is made of."""

    key: str
    shape: Shape
    dtype: torch.dtype
    regions: tuple[Region, ...]
    location: tuple | None = None  # (shared file handle, byte offset) when peers on this machine can map it


@dataclass(frozen=True)
class Piece:
    """One box of one HF tensor: read at `src` in `src_key` on `src_rank`, written at `dst` in `dst_key` on
    `dst_rank`."""

    src_rank: int
    src_key: str
    src: Region
    dst_rank: int
    dst_key: str
    dst: Region
    nbytes: int
    dtype: torch.dtype  # the source's: the bytes travel as the trainer holds them


@dataclass
class Bucket:
    src_rank: int
    dst_rank: int
    pieces: list[Piece] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Phase:
    # rank -> pieces that rank copies itself: from its own tensors, or from a peer's shared parameters
    local: dict[int, list[Piece]]
    rounds: list[list[Bucket]]  # in each round a rank sends at most one bucket and receives at most one


@dataclass
class Plan:
    """The transfer, in phases that run one after the other (one phase unless the targets were split: a streamed
    export fills one window of HF tensors per phase, in memory the next phase reuses)."""

    phases: list[Phase]

    @property
    def local(self) -> dict[int, list[Piece]]:
        merged = defaultdict(list)
        for phase in self.phases:
            for rank, pieces in phase.local.items():
                merged[rank] += pieces
        return dict(merged)

    @property
    def rounds(self) -> list[list[Bucket]]:
        return [round_ for phase in self.phases for round_ in phase.rounds]

    @property
    def reads_peers(self) -> bool:
        """Whether some rank copies straight out of another rank's parameters."""
        return any(p.src_rank != rank for rank, pieces in self.local.items() for p in pieces)

    @property
    def buckets(self) -> list[Bucket]:
        return [bucket for round_ in self.rounds for bucket in round_]

    def bytes_into(self, rank: int) -> int:
        return (sum(p.nbytes for p in self.local.get(rank, ()))
                + sum(b.nbytes for b in self.buckets if b.dst_rank == rank))


def _box(region: Region) -> tuple[Shape, Shape]:
    return region.start, region.stop


def _intersect(a: tuple[Shape, Shape], b: tuple[Shape, Shape]):
    start = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    stop = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    return (start, stop) if all(s < e for s, e in zip(start, stop)) else None


def _subtract(box, hole) -> list:
    """`box` minus `hole` (a box inside it), as disjoint boxes."""
    parts, start, stop = [], list(box[0]), list(box[1])
    for d in range(len(start)):
        if start[d] < hole[0][d]:
            parts.append((tuple(start), tuple(stop[:d] + [hole[0][d]] + stop[d + 1:])))
        if hole[1][d] < stop[d]:
            parts.append((tuple(start[:d] + [hole[1][d]] + start[d + 1:]), tuple(stop)))
        start[d], stop[d] = hole[0][d], hole[1][d]
    return parts


def _restrict(region: Region, box) -> Region:
    """The part of `region` that covers `box` (HF coordinates), in the same local tensor."""
    origin = tuple(o + (s - r) * k for o, s, r, k in zip(region.origin, box[0], region.start, region.steps))
    return Region(region.hf_name, region.hf_shape, box[0], box[1], origin, region.index, region.step)


def _split_rows(piece: Piece, max_bytes: int) -> list[Piece]:
    """Cut a piece larger than a bucket along its first dimension longer than one."""
    extent = [b - a for a, b in zip(piece.src.start, piece.src.stop)]
    dims = [d for d, n in enumerate(extent) if n > 1]
    if piece.nbytes <= max_bytes or not dims:
        return [piece]
    d = dims[0]
    step = max(1, extent[d] * max_bytes // piece.nbytes)
    out = []
    for lo in range(piece.src.start[d], piece.src.stop[d], step):
        hi = min(lo + step, piece.src.stop[d])
        start = piece.src.start[:d] + (lo,) + piece.src.start[d + 1:]
        stop = piece.src.stop[:d] + (hi,) + piece.src.stop[d + 1:]
        box = (start, stop)
        out.append(Piece(piece.src_rank, piece.src_key, _restrict(piece.src, box), piece.dst_rank, piece.dst_key,
                         _restrict(piece.dst, box), piece.nbytes * (hi - lo) // extent[d], piece.dtype))
    return out


def _describe(box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(*box)) + "]"


def build_plan(sources: list[list[TensorSpec]], targets: list[list[TensorSpec]], bucket_bytes: int,
               hosts: list[str] | None = None, phase_of: Callable[[str], int] | None = None,
               read_peers: bool = False) -> Plan:
    """`sources[r]` / `targets[r]`: what rank r holds / must be given. `hosts` (rank -> machine): a piece that
    must travel comes from a holder on the target's machine when there is one (NVLink or shared memory, not the
    network), the least loaded of them. With `read_peers`, sources that have a `location` are read in place by
    the ranks on their machine. With `phase_of` (target key -> phase number), each target is filled in its phase.
    Raises `PlanError` naming the tensor."""

    def same_host(src_rank: int, dst_rank: int) -> bool:
        return hosts is None or hosts[src_rank] == hosts[dst_rank]

    def in_place(src_rank: int, src_spec: TensorSpec, dst_rank: int) -> bool:
        return src_rank == dst_rank or (read_peers and src_spec.location is not None and same_host(src_rank, dst_rank))

    holders: dict[str, list[tuple[int, TensorSpec, Region]]] = defaultdict(list)
    for rank, specs in enumerate(sources):
        for spec in specs:
            for region in spec.regions:
                holders[region.hf_name].append((rank, spec, region))
    errors: list[str] = []
    sent = defaultdict(int)  # bytes each rank sends so far: spread remote reads over the holders
    phases = 1 + max((phase_of(spec.key) for specs in targets for spec in specs), default=0) if phase_of else 1
    local = [defaultdict(list) for _ in range(phases)]  # per phase, like `remote`
    remote: list[dict[tuple[int, int], list[Piece]]] = [defaultdict(list) for _ in range(phases)]
    for dst_rank, specs in enumerate(targets):
        for spec in specs:
            phase = phase_of(spec.key) if phase_of else 0
            for want in spec.regions:
                candidates = holders.get(want.hf_name)
                if not candidates:
                    errors.append(f"'{spec.key}' needs '{want.hf_name}', which no trainer shard holds "
                                  "(a parameter missing from the weight table?)")
                    continue
                shapes = {tuple(r.hf_shape) for _, _, r in candidates}
                if shapes != {tuple(want.hf_shape)}:
                    errors.append(f"'{want.hf_name}': the trainer's shards make shape(s) {sorted(shapes)}, but "
                                  f"'{spec.key}' (rank {dst_rank}) expects {tuple(want.hf_shape)}")
                    continue
                uncovered = [_box(want)]
                ordered = sorted(candidates, key=lambda c: (c[0] != dst_rank, not in_place(c[0], c[1], dst_rank),
                                                            not same_host(c[0], dst_rank), sent[c[0]], c[0]))
                for src_rank, src_spec, have in ordered:
                    still = []
                    for box in uncovered:
                        common = _intersect(box, _box(have))
                        if common is None:
                            still.append(box)
                            continue
                        still += _subtract(box, common)
                        numel = math.prod(b - a for a, b in zip(*common))
                        element = torch.empty((), dtype=src_spec.dtype).element_size()
                        piece = Piece(src_rank, src_spec.key, _restrict(have, common), dst_rank, spec.key,
                                      _restrict(want, common), numel * element, src_spec.dtype)
                        if in_place(src_rank, src_spec, dst_rank):
                            local[phase][dst_rank].append(piece)
                        else:
                            remote[phase][(src_rank, dst_rank)].append(piece)
                            sent[src_rank] += piece.nbytes
                    uncovered = still
                    if not uncovered:
                        break
                for box in uncovered:
                    errors.append(f"'{spec.key}' (rank {dst_rank}) needs '{want.hf_name}'{_describe(box)}, which no "
                                  "trainer shard holds")
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise PlanError("Resharding plan: " + "; ".join(errors[:5]) + more)
    return Plan([Phase(dict(copies), _rounds(sends, bucket_bytes)) for copies, sends in zip(local, remote)])


def _rounds(remote: dict[tuple[int, int], list[Piece]], bucket_bytes: int) -> list[list[Bucket]]:
    per_pair: dict[tuple[int, int], list[Bucket]] = {}
    for pair in sorted(remote):
        buckets = [Bucket(*pair)]
        for piece in (p for whole in remote[pair] for p in _split_rows(whole, bucket_bytes)):
            offset = -(-buckets[-1].nbytes // ALIGN) * ALIGN
            if buckets[-1].pieces and offset + piece.nbytes > bucket_bytes:
                buckets.append(Bucket(*pair))
                offset = 0
            bucket = buckets[-1]
            bucket.pieces.append(piece)
            bucket.offsets.append(offset)
            bucket.nbytes = offset + piece.nbytes
        per_pair[pair] = buckets
    # Every rank packs what it sends in a round while its peers do the same, then unpacks what it receives:
    # all ranks copy at once, and no send waits on a receive that comes later.
    rounds = []
    while any(per_pair.values()):
        senders, receivers, round_ = set(), set(), []
        for (src, dst), buckets in per_pair.items():
            if buckets and src not in senders and dst not in receivers:
                round_.append(buckets.pop(0))
                senders.add(src)
                receivers.add(dst)
        rounds.append(round_)
    return rounds
