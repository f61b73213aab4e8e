"""Moving a Megatron model's training state off the device between phases and back (the hybrid engine: while
vLLM generates, the trainer's parameters, gradients and optimizer state need not hold device memory).

The unit that moves is a tensor *storage*, not a tensor: Megatron keeps many views of one storage (DDP's
contiguous grad buffer behind every `param.main_grad`, its param buffer behind every `param.data` with the
distributed optimizer, fp32 master shards that view the params). `to_host` copies each storage into a host buffer
(pinned on GPU) and resizes the storage to 0 bytes, which really frees it (on GPU after `empty_cache`); every view
keeps its shape, offset and identity, so optimizers, DDP hooks and the resharding plan see the same objects.
`to_device` reallocates each storage at its size and copies the bytes back: the state is bitwise what it was.
Gradients are not copied: every mini-batch starts by zeroing them (`zero_grad_buffer`, `optimizer.zero_grad`), so
nothing reads them across a phase change; `to_host` frees them and `to_device` reallocates them as zeros (verl's
Megatron offload does the same with DDP's grad buffers). Each storage's host buffer is made once and reused by
every later `to_host`: pinned memory is costly to allocate, and new buffers per phase would grow PyTorch's pinned
host cache without bound.

Categories, by priority (a storage that several reference moves with the first one, and only when it is asked for):
  "params"    - the model's parameters (and DDP's param buffer);
  "grads"     - DDP's grad buffers (`param.main_grad`), `.grad` of params and of the optimizer's master params
                (dropped and re-zeroed, never copied);
  "optimizer" - the optimizer's master params (fp32 copies under bf16) and its state (Adam's moments, step).
With the plain fp32 optimizer the master params *are* the model's parameters: they stay with "params".

Storages that cannot be resized stay where they are and are counted as kept: on CPU the policy's parameters live
in a file in /dev/shm that the peers' engines map and read at each weight sync (`resharding.shared_params`);
releasing them would break that mapping, and on CPU they are host memory already, so there is nothing to gain.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from rl_megatron import platform

CATEGORIES = ("params", "grads", "optimizer")


@dataclass
class OffloadStats:
    """Bytes per category: moved (copied to host by `to_host`, back by `to_device`), dropped (gradients: freed by
    `to_host` without a copy, reallocated as zeros by `to_device`) and kept (not resizable, left)."""
    moved: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, category: str, nbytes: int) -> None:
        counts = getattr(self, kind)
        counts[category] = counts.get(category, 0) + nbytes


@dataclass
class _Away:
    storage: torch.UntypedStorage  # the device storage, 0 bytes while away
    nbytes: int
    category: str

    @property
    def copied(self) -> bool:
        return self.category != "grads"


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (one per chained part: dense, expert, ...)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "optimizer", None) is not None:
            yield part.optimizer


class Offloader:
    """Moves the state of `model` (this rank's model chunks, DDP-wrapped or not) and `optimizer` (a Megatron
    optimizer, or None for a frozen model) between the device and the host. Calls are idempotent: what is already
    on the host (device) is skipped by `to_host` (`to_device`), so the trainer can call them at every phase change.
    """

    def __init__(self, model: list[torch.nn.Module], optimizer=None):
        self.model, self.optimizer = model, optimizer
        self._away: dict[int, _Away] = {}  # by storage identity
        self._host: dict[int, torch.Tensor] = {}  # a host buffer per copied storage, reused by every `to_host`

    def _tensors(self) -> dict[str, Iterable[torch.Tensor]]:
        params = [p for chunk in self.model for p in chunk.parameters()]
        master = [p for opt in torch_optimizers(self.optimizer) for group in opt.param_groups
                  for p in group["params"]]
        state = [v for opt in torch_optimizers(self.optimizer) for per_param in opt.state.values()
                 for v in per_param.values() if isinstance(v, torch.Tensor)]
        grads = [g for p in params + master for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        return {"params": params, "grads": grads, "optimizer": master + state}

    def _storages(self, categories: tuple[str, ...]) -> list[tuple[torch.UntypedStorage, str]]:
        """The device storages of `categories`, each once, under its highest-priority category."""
        device = platform.device()
        seen: set[int] = set()
        found = []
        for category, tensors in self._tensors().items():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = storage._cdata  # the storage itself: stable across resizes, shared by all its views
                if key in seen or tensor.device.type != device.type:
                    continue
                seen.add(key)
                if category in categories:
                    found.append((storage, category))
        return found

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        if key not in self._host or self._host[key].numel() != nbytes:
            self._host[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=platform.has_cuda())
        return self._host[key]

    def to_host(self, *categories: str) -> OffloadStats:
        """Free the storages of `categories` (default: all) on the device, their bytes copied to host buffers first
        (gradients are not copied)."""
        categories = self._check(categories)
        stats = OffloadStats()
        leaving = []
        for storage, category in self._storages(categories):
            key = storage._cdata
            if key in self._away or storage.nbytes() == 0:
                continue
            if not storage.resizable():
                stats.add("kept", category, storage.nbytes())
                continue
            away = _Away(storage, storage.nbytes(), category)
            if away.copied:
                self._host_buffer(key, away.nbytes).copy_(_byte_view(storage), non_blocking=True)
            leaving.append((key, away))
            stats.add("moved" if away.copied else "dropped", category, away.nbytes)
        self._synchronize()  # the copies are complete before their source is freed
        for key, away in leaving:
            away.storage.resize_(0)
            self._away[key] = away
        if platform.has_cuda():
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, for vLLM to take
        return stats

    def to_device(self, *categories: str) -> OffloadStats:
        """Reallocate the storages of `categories` (default: all) that `to_host` freed: copied bytes come back,
        gradients come back as zeros."""
        categories = self._check(categories)
        stats = OffloadStats()
        returning = [key for key, away in self._away.items() if away.category in categories]
        for key in returning:
            away = self._away.pop(key)
            away.storage.resize_(away.nbytes)
            if away.copied:
                _byte_view(away.storage).copy_(self._host[key], non_blocking=True)
            else:
                _byte_view(away.storage).zero_()
            stats.add("moved" if away.copied else "dropped", away.category, away.nbytes)
        self._synchronize()  # the host buffers are read before the next `to_host` reuses them
        return stats

    def off_device(self) -> dict[str, int]:
        """Bytes per category currently off the device (on the host, or dropped gradients)."""
        away: dict[str, int] = {}
        for entry in self._away.values():
            away[entry.category] = away.get(entry.category, 0) + entry.nbytes
        return away

    @staticmethod
    def _check(categories: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"Offload categories {unknown} are unknown: use any of {', '.join(CATEGORIES)}.")
        return categories or CATEGORIES

    @staticmethod
    def _synchronize() -> None:
        if platform.has_cuda():
            torch.cuda.synchronize()
