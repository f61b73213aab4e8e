"""Count the places where a GPU run's host would wait for the GPU, on any device (CPU included).

A host sync happens when Python needs a value that only the device has: `.item()`, `.tolist()`, `bool(t)` (an
`if` on a tensor), `float(t)`, a copy to the host, and the operations whose output size depends on the data
(`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`, ...), and a
copy to the GPU that is not `non_blocking` (from pageable memory it waits for the GPU's queue), which includes
`torch.tensor(data, device=...)`.
`torch.cuda.set_sync_debug_mode` reports them on a GPU; this counter finds the same operations by intercepting
every torch call (a `TorchFunctionMode`), so the figure is measured on CPU too.

On CPU every tensor is a host tensor, so the counter tracks which tensors a GPU run would hold on the GPU: the
model's and optimizer's tensors given at the start, what is moved to the compute device (`.to(device)`, `.cuda()`),
what a factory creates with an explicit `device=` (Megatron and the project write `device=...` exactly for the
tensors that live on the GPU), and every output of an operation that reads one of these. A sync operation on such
a tensor counts; on a host tensor it does not (a GPU run reads host tensors for free). Moving a device tensor to the
host counts and gives a host tensor. On a GPU, `gpu_sync_warnings` cross-checks the figure with
`torch.cuda.set_sync_debug_mode("warn")`.
"""
from __future__ import annotations

import collections
import traceback
import warnings
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from rl_megatron import platform

# Calls that read a device value on the host whatever their arguments.
READS_VALUE = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy,
               torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.masked_select, torch.masked_select,
               torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.equal, torch.allclose,
               torch.Tensor.allclose, torch.bincount, torch.Tensor.bincount}


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _names_host(device, compute_device: torch.device) -> bool:
    """Whether `device` (a `device=` or `.to()` argument) names the host. On CPU the compute device is the CPU too:
    there a `torch.device` names the compute device (the project writes `.to(platform.device())`) and the string
    "cpu" names the host (it writes `.to("cpu")` or `.cpu()` for host copies)."""
    if isinstance(device, str):
        return device == "cpu"
    if isinstance(device, torch.device):
        return device.type == "cpu" and compute_device.type != "cpu"
    return False


class HostSyncCounter(TorchFunctionMode):
    """A mode counting the calls that would wait for the GPU (module docstring). `count` is the total; `sites`
    counts them per (operation, the caller's file:line), the most frequent first in `report()`."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = (), compute_device: torch.device | None = None):
        super().__init__()
        self._on_device: dict[int, weakref.ref] = {}
        self.compute_device = compute_device or torch.device("cpu")
        self.count = 0
        self.sites: collections.Counter = collections.Counter()
        for tensor in device_tensors:
            self.mark(tensor)

    def mark(self, tensor: torch.Tensor) -> None:
        """Count `tensor` as one a GPU run holds on the GPU."""
        key = id(tensor)
        self._on_device[key] = weakref.ref(tensor, lambda _, key=key: self._on_device.pop(key, None))

    def on_device(self, tensor: torch.Tensor) -> bool:
        ref = self._on_device.get(id(tensor))
        return ref is not None and ref() is tensor

    def _move(self, func, args, kwargs) -> str | None:
        """"host" or "device" for a call that moves a tensor there, else None."""
        if func is torch.Tensor.cpu:
            return "host"
        if func is torch.Tensor.cuda:
            return "device"
        if func is not torch.Tensor.to:
            return None
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if target is None:
            return None
        return "host" if _names_host(target, self.compute_device) else "device"

    def _syncs(self, func, args, kwargs, move: str | None) -> int:
        """How many host syncs this call makes (0 for most)."""
        inputs = _tensors((args, kwargs))
        if move == "device" and not self.on_device(args[0]):
            # A copy up that may not run ahead (from pageable memory) waits for the GPU's queue.
            return int(not (kwargs.get("non_blocking") or any(arg is True for arg in args[2:])))
        if func is torch.tensor and not _names_host(kwargs.get("device", "cpu"), self.compute_device):
            return 1  # built on the host, then copied up with the host waiting
        if not any(self.on_device(t) for t in inputs):
            return 0
        if func in READS_VALUE or move == "host":
            return 1
        if func in (torch.tensor, torch.as_tensor):
            # A list of device values is read through the host, each; a tensor is converted where it is.
            data = args[0] if args else kwargs.get("data")
            return 0 if isinstance(data, torch.Tensor) else sum(self.on_device(t) for t in _tensors(data))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            if func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor):
                return 0  # a mask assigned a number is a masked_fill_: no read-back
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            return int(any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and self.on_device(p)
                           for p in parts))
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return int(isinstance(repeats, torch.Tensor) and self.on_device(repeats)
                       and kwargs.get("output_size") is None)
        if func is torch.where and len(args) == 1 and not kwargs:
            return 1
        return 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        move = self._move(func, args, kwargs)
        syncs = self._syncs(func, args, kwargs, move)
        if syncs:
            self._record(func, syncs)
        out = func(*args, **kwargs)
        if move is not None and isinstance(out, torch.Tensor):
            if out is args[0] and self.on_device(out) != (move == "device"):
                out = out.clone()  # on CPU the move returns the tensor itself; a GPU run holds a separate copy
            if move == "device":
                self.mark(out)
            return out
        device = kwargs.get("device")
        if (device is not None and not _names_host(device, self.compute_device)) or (
                not syncs and any(self.on_device(t) for t in _tensors((args, kwargs)))):
            for tensor in _tensors(out):
                self.mark(tensor)
        return out

    def _record(self, func, times: int) -> None:
        caller = next((frame for frame in reversed(traceback.extract_stack(limit=12))
                       if frame.filename != __file__ and "/torch/" not in frame.filename), None)
        where = f"{caller.filename.rsplit('site-packages/', 1)[-1]}:{caller.lineno}" if caller else "?"
        self.count += times
        self.sites[(getattr(func, "__name__", str(func)), where)] += times

    def report(self, top: int = 10) -> list[str]:
        """The most frequent sync sites, as "N x operation at file:line"."""
        return [f"{n} x {name} at {where}" for (name, where), n in self.sites.most_common(top)]


def module_tensors(objects: Iterable) -> Iterator[torch.Tensor]:
    """The tensors a GPU run holds on the GPU for these modules and optimizers: parameters, buffers, gradients
    (Megatron's `main_grad` too) and optimizer states."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for param in torch.nn.Module.parameters(obj):
                yield param
                for grad in (param.grad, getattr(param, "main_grad", None)):
                    if grad is not None:
                        yield grad
            yield from torch.nn.Module.buffers(obj)
            # Megatron DDP's contiguous parameter and gradient buffers (its `buffers` attribute is theirs).
            for buffer in getattr(obj, "buffers", None) if isinstance(getattr(obj, "buffers", None), list) else []:
                yield from _tensors([buffer.param_data, buffer.grad_data])
        for optimizer in getattr(obj, "chained_optimizers", None) or [obj]:
            torch_optimizer = getattr(optimizer, "optimizer", optimizer)
            if isinstance(torch_optimizer, torch.optim.Optimizer):
                for group in torch_optimizer.param_groups:
                    yield from group["params"]
                for state in torch_optimizer.state.values():
                    # torch's Adam keeps its step count on the host unless capturable or fused
                    yield from _tensors({key: value for key, value in state.items() if key != "step"})
            for groups in ("fp32_from_float16_groups", "float16_groups", "fp32_from_fp32_groups"):
                for group in getattr(optimizer, groups, None) or []:
                    yield from group


def count_syncs(model, fn: Callable[[], object]) -> HostSyncCounter:
    """The host syncs of `fn()`, a pass of `model` (a `MegatronModel`: its chunks, DDP wrappers and optimizer hold
    the device tensors to start from). Run one update before, so that the optimizer's state exists."""
    counter = HostSyncCounter(module_tensors([*model.model, *model.chunks, model.optimizer]), platform.device())
    with counter:
        fn()
    return counter


def gpu_sync_warnings(fn: Callable[[], object]) -> int:
    """On a GPU: the syncs CUDA itself reports while `fn()` runs (`torch.cuda.set_sync_debug_mode("warn")`)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sum("synchronizing" in str(w.message).lower() for w in caught)
