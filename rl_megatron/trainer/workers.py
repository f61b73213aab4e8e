"""Starting the worker groups of a run: one per pool of `config.pools.worker_pools`, each role mapped to its group."""
from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack

from rl_megatron.config import Config
from rl_megatron.config.pools import threads_per_worker, worker_pools
from rl_megatron.platform.determinism import deterministic_env
from rl_megatron.roles import Role, roles_name
from rl_megatron.rollout.engine import engine_class
from rl_megatron.workers.debugging import debugger_env
from rl_megatron.workers.hybrid_worker import HybridWorker
from rl_megatron.workers.rollout_worker import JudgeWorker, RolloutWorker
from rl_megatron.workers.worker_group import ResourcePool, WorkerGroup
from rl_megatron.workers.run_logs import logs_dir

logger = logging.getLogger(__name__)


def build_workers(cfg: Config, hf_config: dict, cpus: int, stack: ExitStack) -> dict[Role, WorkerGroup]:
    """The worker groups, by role (a colocated role maps to the actor's group); closed by `stack`."""
    pools = worker_pools(cfg)
    threads = threads_per_worker(cfg, cpus)
    env = worker_env(threads, local_cluster=cfg.ray.address is None, deterministic=cfg.trainer.deterministic,
                     engine_env=engine_class(cfg.rollout.engine).process_env)
    logs = logs_dir(cfg.trainer.run_dir)
    launched: list[tuple[tuple[Role, ...], WorkerGroup]] = []
    for pool in pools:  # every pool's workers launched first, so that their start-ups overlap
        devices = ResourcePool(pool.nnodes, pool.gpus_per_node, config_keys=(pool.nodes_key, pool.gpus_key))
        name = roles_name(pool.roles)  # what a dead worker's report calls its group
        engines = {(Role.ROLLOUT,): RolloutWorker, (Role.JUDGE,): JudgeWorker}.get(pool.roles)
        if engines is not None:
            group = WorkerGroup(engines, devices, cfg, hf_config, threads, logs, env=env, name=name, start=False)
        else:
            group = WorkerGroup(HybridWorker, devices, cfg, hf_config, pool.roles, pool.layout, threads, logs,
                                env=env, name=name, start=False)
        launched.append((pool.roles, stack.enter_context(group)))
    groups: dict[Role, WorkerGroup] = {}
    started = time.perf_counter()
    for roles, group in launched:
        groups.update(dict.fromkeys(roles, group.wait_started()))
        logger.info("start-up: %s workers ready %.1f s after all were launched (process, Megatron, rollout "
                    "engine)", group.name, time.perf_counter() - started)
    if groups[Role.ROLLOUT] is not groups[Role.ACTOR]:
        connect_engines(groups[Role.ACTOR], groups[Role.ROLLOUT])
    return groups


def connect_engines(actor: WorkerGroup, rollout: WorkerGroup) -> None:
    """Separate engines: the actor's rank 0 and every engine worker form the group the weights are broadcast in."""
    host, port = actor.rank0_address()
    size = 1 + rollout.pool.world_size
    joining = rollout.call_async("join_weight_group", host, port, size)
    actor.join_weight_group(host, port, size)
    rollout.get(joining)


def sync_weights(actor: WorkerGroup, rollout: WorkerGroup) -> None:
    """The policy's current weights into the engines: colocated, each actor worker writes its engines' share;
    separate, the actor's rank 0 broadcasts them and the engine workers receive (both at once)."""
    receiving = [] if rollout is actor else rollout.call_async("sync_weights")
    actor.sync_weights()
    rollout.get(receiving)


def worker_env(threads: int, local_cluster: bool, deterministic: bool = False,
               engine_env: dict[str, str] | None = None) -> dict:
    """What the driver decides for every worker. Nothing here depends on a device: each worker sets what its own
    device needs (`RolloutEngine.configure_process`), since the driver may have no GPU while the workers do.
    `engine_env`: the engine's `RolloutEngine.process_env`. Ray's debugger variables go along: a cluster's nodes may
    have been started without them; so do trainer.deterministic's (harmless without a GPU), which CUDA, cuBLAS and NCCL
    read when they start."""
    env = {**(engine_env or {}), "OMP_NUM_THREADS": str(threads), **debugger_env()}
    if deterministic:
        env.update(deterministic_env(os.environ))
    if local_cluster:  # everything on this machine: keep gloo on the loopback interface
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env
