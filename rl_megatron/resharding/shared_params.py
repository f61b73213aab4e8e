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
import warnings

import torch

from rl_megatron.resharding.channels import SharedBuffer, shared_file_prefix
from rl_megatron.resharding.plan import ALIGN

_OWN: list[SharedBuffer] = []  # this process's shared parameter files
_PEERS: dict[tuple, SharedBuffer] = {}  # peers' files mapped here, by handle


def _remove_files_of_dead_processes() -> None:
    """The files of processes of this PID namespace that died without removing them (other namespaces' are theirs:
    their process ids mean nothing here)."""
    prefix = shared_file_prefix()
    for path in glob.glob(f"{prefix}*"):
        pid = int(path[len(prefix):].split("-")[0])
        if not os.path.exists(f"/proc/{pid}"):
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
