"""A worker of the rollout pool when the engines have devices of their own (rollout.placement=separate): one engine
(or its TP shard) per device, which receives the policy's weights over the weight group after each update
(see `resharding/broadcast.py`). A judge of its own (judge.model.path) runs in `JudgeWorker`s: the same engine host
with the judge's model, loaded once from its folder."""
from __future__ import annotations

import torch

from rl_megatron.config.schema import Config
from rl_megatron.platform.startup import startup_done
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.plugins import import_user_modules
from rl_megatron.rewards.judge import JUDGE_PATH_KEY, judge_engine_settings
from rl_megatron.resharding.broadcast import leave_weight_group, receive_weights, weight_group, write_engine_regions
from rl_megatron.roles import Role
from rl_megatron.workers.distributed import connect_store, init_distributed, rendezvous_address
from rl_megatron.workers.engine_host import EngineHost
from rl_megatron.workers.worker_group import dispatch


class RolloutWorker(EngineHost):
    ROLE = Role.ROLLOUT

    def __init__(self, rank: int, world_size: int, cfg: Config, hf_config: dict, threads: int, logs: str):
        self.rank, self.world_size, self.cfg, self.hf_config = rank, world_size, cfg, hf_config
        self.roles = (self.ROLE,)
        self.weight_group = None
        self._init_engine_host(logs)
        torch.set_num_threads(threads)  # before vLLM starts (see HybridWorker)
        import_user_modules(cfg.trainer.imports)

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def init(self, master_addr: str, master_port: int) -> None:
        # The pool's own world: an engine of TP > 1 runs its shards in it (vLLM's external launcher).
        init_distributed(self.rank, self.world_size, connect_store(master_addr, master_port), tp=1, pp=1,
                         seed=self.cfg.trainer.seed)
        self._start_engine()
        self.targets = self.engine.sync_targets()
        startup_done()

    def mesh(self) -> dict:
        return {"rollout": self._rollout_axis()}

    # This engine has devices of its own: it never sleeps, and its weights change only when the trainer sends them
    # (after every update, before the next generation), so no phase asks for a move here.
    def enter(self, phase) -> None:
        pass

    def leave(self, phase) -> None:
        pass

    @dispatch(axis=None)
    def join_weight_group(self, host: str, port: int, size: int) -> None:
        self.weight_group = weight_group(host, port, 1 + self.rank, size)

    @dispatch(axis=None)
    def sync_weights(self) -> None:
        """Receive the policy's weights from the actor's rank 0 and write this engine's share of them."""
        self.engine.wake_up(("weights",))
        for tensors in receive_weights(self.weight_group):
            write_engine_regions(self.targets, tensors)
        self.engine.weights_updated()

    def close(self) -> None:
        leave_weight_group(self.weight_group)
        self.engine.release_process_groups()  # the process ends next


class JudgeWorker(RolloutWorker):
    """An engine (or its TP shard) of a judge of its own: judge.model.path's weights, as any vLLM user loads them, at
    `judge_engine_settings`; asked only to generate (verdicts), never sent weights."""
    ROLE = Role.JUDGE

    def init(self, master_addr: str, master_port: int) -> None:
        init_distributed(self.rank, self.world_size, connect_store(master_addr, master_port), tp=1, pp=1,
                         seed=self.cfg.trainer.seed)
        self._start_engine()
        startup_done()

    def _start_engine(self) -> None:
        path = self.cfg.judge.model.path
        settings = judge_engine_settings(self.cfg, read_hf_config(path, JUDGE_PATH_KEY))
        self.engine_tp = settings.tensor_parallel_size
        self.engine_index = self.rank // self.engine_tp
        self.engine = self.engine_class(path, settings, self.cfg.model.dtype,
                                        seed=self.cfg.trainer.seed + self.engine_index, load_format="auto")

    def close(self) -> None:
        self.engine.release_process_groups()
