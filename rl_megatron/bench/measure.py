"""What the single-process benchmarks share: timing on the bench's device, the matrix-multiply FLOP/s they are
compared with, and the actor they measure."""
from __future__ import annotations

import time
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.config.schema import Config


def synchronize() -> None:
    """Wait for the device's queued work, so that a host clock measures it (a no-op on CPU)."""
    if platform.has_cuda():
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """Mean seconds of `fn()` over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the tensor storages created inside, live and at their peak: every operation's new outputs (not
    views or in-place results, which share an input's storage), each counted until its storage is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


def peak_extra_memory(fn) -> int:
    """Bytes above what was allocated before, at the peak of `fn()`: CUDA's allocator statistics on a GPU, the
    tensors created inside (`LiveTensorBytes`) on CPU."""
    if platform.has_cuda():
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveTensorBytes() as tracker:
        fn()
    return tracker.peak


def matmul_flops_per_s(m: int, k: int, n: int, seconds: float = 1.0, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a plain [m, k] x [k, n] matrix multiply on `device`, repeated for about `seconds`."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    synchronize()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        synchronize()
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start)


def bench_config(args, model_dir: str, dtype: str = "float32", overrides: Sequence[str] = ()) -> Config:
    """The config of a one-process actor (a colocated worker's layout) over the model in `model_dir`, random weights,
    whose mini-batch is the whole batch of `args.batch` sequences of `args.seq` tokens (half of them the response);
    `overrides` (`key=value`) on top."""
    from rl_megatron.preflight import load_config

    response = args.seq // 2
    return load_config(None, [f"model.path={model_dir}", "model.random_init=true", f"model.dtype={dtype}",
                              "trainer.n_gpus_per_node=1", f"rollout.max_tokens={response}",
                              f"rollout.max_model_len={args.seq + 8}", f"data.max_prompt_length={args.seq - response}",
                              "rollout.n=1", f"data.train_batch_size={args.batch}",
                              f"actor.ppo_mini_batch_size={args.batch}", f"actor.micro_batch_size={min(args.batch, 8)}",
                              "actor.optim.lr=1e-5", "model.make_vocab_size_divisible_by=1", *overrides])


def random_batch(args, vocab: int) -> TrainBatch:
    """`args.batch` random sequences of `args.seq` tokens whose second half is the response."""
    response = args.seq // 2
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch(torch.randint(3, vocab, (args.batch, args.seq), generator=g),
                       torch.zeros(args.batch, args.seq), pad_id=0, advantages=torch.randn(args.batch, generator=g))
    batch.response_mask[:, args.seq - response - 1:-1] = 1.0
    return batch


def build_actor_and_batch(args, model_dir: str, dtype: str = "float32", overrides: Sequence[str] = ()):
    """The actor in a one-process world (a colocated worker's layout) over the model in `model_dir` (`bench_config`,
    with `overrides`), with `random_batch`. The whole batch is one PPO mini-batch, so an update is one optimizer step.
    Returns (actor, HF config, batch). The world is formed here unless the process has one (the doctor's one-rank
    world)."""
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.distributed import init_distributed, listen_store
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = read_hf_config(model_dir)
    cfg = bench_config(args, model_dir, dtype, overrides)
    if not dist.is_initialized():
        init_distributed(0, 1, listen_store("127.0.0.1"), 1, 1, seed=0)
    actor = MegatronActor(cfg, hf, optimizer_steps=100)
    return actor, hf, random_batch(args, hf["vocab_size"])
