"""Joining a Ray cluster, or starting a private local one."""
from __future__ import annotations

import os

from rl_megatron.config.schema import Config


class ClusterError(RuntimeError):
    """Ray could not give the run what it needs; the message says what to do."""


def start_ray(cfg: Config) -> int:
    """Join `ray.address`, or start a local Ray; returns the CPUs the cluster offers."""
    import ray

    if cfg.ray.address is None:
        # A local, private Ray: no usage stats, no auth token written to the home folder.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        try:
            if cfg.ray.address is None:
                ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                         object_store_memory=cfg.ray.object_store_memory, _node_ip_address="127.0.0.1")
            else:
                ray.init(address=cfg.ray.address)
        except Exception as err:
            raise ClusterError(f"Ray failed to start ({type(err).__name__}: {err}). Check ray.address, that no "
                               "stale Ray runs (`ray stop`) and that /dev/shm has room.") from None
    cpus = int(ray.cluster_resources().get("CPU", 1))
    devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.ray.address is None and cpus < devices:
        raise ClusterError(f"The actor needs {devices} CPU slots (trainer.nnodes x trainer.n_gpus_per_node) but "
                           f"Ray has {cpus}. Lower trainer.n_gpus_per_node or raise ray.num_cpus.")
    return cpus
