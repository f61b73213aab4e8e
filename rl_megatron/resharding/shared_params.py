"""Trainer shards that other processes on the same machine read in place (CPU).

`share_parameters` moves this rank's Megatron parameters into one file in /dev/shm (the parameters become
views of it; nothing else changes for Megatron). A rank that needs a piece of a peer's shard then maps the
peer's file and copies the piece straight into its engine: one copy per byte, as for its own shards, and no
bucket, no send, no extra memory. (On GPU the same idea is CUDA IPC of the parameter buffer; there the
resharder sends buckets over NCCL instead.)
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import math
import os
import shutil
import threading
import time
import warnings

import torch

from rl_megatron.resharding.channels import SharedBuffer, shared_file_prefix
from rl_megatron.resharding.plan import ALIGN

_OWN: list[SharedBuffer] = []  # this process's shared parameter files
_PEERS: dict[tuple, SharedBuffer] = {}  # peers' files mapped here, by handle


def _remove_files_of_dead_processes() -> None:
    """The files of processes of this PID namespace that died without removing them (other namespaces' are theirs:
    their process ids mean nothing here)."""
    for path in glob.glob(f"{shared_file_prefix()}*"):
        if not _alive(_creator(path)):
            with contextlib.suppress(FileNotFoundError):  # every worker on the machine sweeps at once
                os.unlink(path)


def unlink_shared_parameters() -> None:
    """Remove this process's files from /dev/shm (at exit at the latest; the memory lives while it is mapped).
    Files of processes that died without it are removed by the next `share_parameters` on the machine."""
    for buffer in _OWN:
        buffer.unlink()


def share_parameters(modules: list[torch.nn.Module]) -> bool:
    """Move the parameters of `modules` into shared memory; False (parameters untouched) when /dev/shm lacks
    room for them with headroom, in which case syncs send those pieces in buckets instead."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
    total = sum(sizes)
    _remove_files_of_dead_processes()
    if not params:
        return False
    free = shutil.disk_usage("/dev/shm").free
    if free < 2 * total:
        warnings.warn(f"/dev/shm has {free >> 20} MiB free, too little to share this rank's {total >> 20} MiB of "
                      "parameters: weight syncs will send buckets instead (slower). Give the container more "
                      "(docker run --shm-size=...).")
        return False
    buffer = SharedBuffer.create(total)
    if not _OWN:
        atexit.register(unlink_shared_parameters)
    _OWN.append(buffer)
    offset = 0
    with torch.no_grad():
        for param, size in zip(params, sizes):
            view = buffer.tensor[offset:offset + param.numel() * param.element_size()].view(param.dtype)
            view = view.view(param.shape)
            view.copy_(param.data)
            param.data = view
            offset += size
    return True


def location(tensor: torch.Tensor):
    """(file handle, byte offset) of a tensor that lives in this process's shared parameters, else None."""
    if not tensor.is_contiguous():
        return None
    for buffer in _OWN:
        base, end = buffer.tensor.data_ptr(), buffer.tensor.data_ptr() + buffer.tensor.numel()
        if base <= tensor.data_ptr() < end:
            return buffer.handle, tensor.data_ptr() - base
    return None


def peer_tensor(where, dtype: torch.dtype, shape) -> torch.Tensor:
    """A peer's shared parameter, mapped into this process (the file is mapped once per process)."""
    handle, offset = where
    if handle not in _PEERS:
        _PEERS[handle] = SharedBuffer.attach(handle)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return _PEERS[handle].tensor[offset:offset + nbytes].view(dtype).view(shape)


_FENCE = threading.Lock()  # taking and releasing a lock is a full memory barrier on every CPU (pthreads)

# How long a rank waits for a peer's counter before it takes the peer for dead: torch's default collective timeout.
WAIT_LIMIT_S = 1800.0


class PeerReads:
    """The two handshakes of reading peers' parameters in place during a sync, through counters in shared memory:
    before a rank reads a peer's shards, the peer has said that its parameters are final for this sync (`ready`);
    before a sync returns, every rank reading this rank's shards has said it is done (`done`). A rank waits only on
    the ranks it reads (`sources`) and those that read it (`readers`), where a barrier of the whole process group
    would take a round of gloo's TCP messages among all ranks (~17% of a sync on a loaded 2-core machine).

    Sync n sets this rank's two counters to n. The copies and the counters are ordered by memory barriers (`_FENCE`)
    on either side, so a weakly ordered CPU cannot let a counter overtake the reads or writes before it."""

    READY, DONE = 0, 1

    def __init__(self, sources: set[int], readers: set[int]):
        self.sources, self.readers = sorted(sources), sorted(readers)
        self.own = SharedBuffer.create(2 * 8)  # a new file reads as zeros: no sync yet
        self.counters = self.own.tensor.view(torch.int64)
        self.peers: dict[int, torch.Tensor] = {}
        self.pids: dict[int, int | None] = {}  # the peers' process ids, where this PID namespace can see them
        self.count = 0

    def connect(self, handles: list) -> None:
        """`handles`: every rank's `own.handle`; maps the counters of the ranks this one waits on. After every rank
        has connected (a barrier), `own.unlink()` leaves nothing behind in /dev/shm."""
        waits_on = {*self.sources, *self.readers}
        self.peers = {rank: SharedBuffer.attach(handles[rank]).tensor.view(torch.int64) for rank in waits_on}
        self.pids = {rank: _creator(handles[rank][0]) for rank in waits_on}

    def ready(self) -> None:
        """This rank's parameters are final for the next sync."""
        self.count += 1
        _fence()
        self.counters[self.READY] = self.count

    def wait_for_sources(self) -> None:
        self._wait(self.sources, self.READY, "start this sync")

    def done(self) -> None:
        """This rank has read what it reads of its peers in this sync."""
        _fence()
        self.counters[self.DONE] = self.count

    def wait_for_readers(self) -> None:
        self._wait(self.readers, self.DONE, "finish reading this rank's parameters")

    def _wait(self, ranks: list[int], which: int, what: str) -> None:
        start = time.monotonic()
        for rank in ranks:
            counter, polls = self.peers[rank], 0
            while int(counter[which]) < self.count:
                polls += 1
                time.sleep(0 if polls < 100 else 1e-4)  # yield the core at first, then sleep between looks
                if polls % 1000 == 0:
                    pid = self.pids[rank]
                    if pid is not None and not _alive(pid):
                        raise RuntimeError(f"Weight sync: rank {rank} (process {pid}) died before it could {what} "
                                           "(see its log).")
                    if time.monotonic() - start > WAIT_LIMIT_S:
                        raise RuntimeError(f"Weight sync: waited {WAIT_LIMIT_S:.0f} s for rank {rank} to {what}; "
                                           "that worker may be stuck (see its log).")
        _fence()


def _creator(path: str) -> int | None:
    """The process id in a shared file's name, where it names a process of this PID namespace (a peer's file from
    another namespace names a process this one cannot see)."""
    prefix = shared_file_prefix()
    return int(path[len(prefix):].split("-")[0]) if path.startswith(prefix) else None


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _fence() -> None:
    with _FENCE:
        pass
