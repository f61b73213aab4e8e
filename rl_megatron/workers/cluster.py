"""Joining a Ray cluster, or starting a private local one; what the cluster offers, for error messages."""
from __future__ import annotations

import logging
import os
import socket
import time

from rl_megatron.config.schema import Config
from rl_megatron.workers.debugging import attach_hint, ray_debugger, setup_problem
from rl_megatron.workers.reaper import start_reaper


# Workers write their output to the run's log files (`workers/run_logs.py`), not the console; Ray's own INFO
# lines ("Started a local Ray instance") are not for the user either.
QUIET = {"log_to_driver": False, "logging_level": logging.WARNING}
logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """Ray could not give the run what it needs; the message says what to do."""


def start_ray(cfg: Config) -> int:
    """Join `ray.address`, or start a local Ray; returns the CPUs the cluster offers. With RAY_DEBUG set, says how
    to attach to a worker paused at a breakpoint (a local Ray then starts its dashboard, for VS Code)."""
    import ray

    problem = setup_problem(starts_dashboard=cfg.ray.address is None)
    if problem:
        raise ClusterError(problem)
    if cfg.ray.address is None:
        # A local, private Ray: no usage stats, no auth token written to the home folder; its processes end with
        # this one, however it ends.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        start_reaper()
    started = time.perf_counter()
    if not ray.is_initialized():
        try:
            if cfg.ray.address is None:
                # address="local": always a new instance, never a cluster someone else started on this machine.
                # Ray would start idle workers for tasks at once; the run's workers (actors with their own
                # environment) never use them, and starting them costs seconds of CPU during the run's start-up. The
                # dashboard only for RAY_DEBUG=1: VS Code's debugger extension lists paused workers through it.
                ray.init(address="local", num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                         include_dashboard=ray_debugger() == "1", object_store_memory=cfg.ray.object_store_memory,
                         _node_ip_address="127.0.0.1",
                         _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
                         **QUIET)
            else:
                ray.init(address=head_address(cfg.ray.address, cfg.ray.connect_timeout_s), **QUIET)
        except ClusterError:
            raise
        except Exception as err:
            raise ClusterError(f"Ray failed to start ({type(err).__name__}: {err}). Check ray.address, that no "
                               "stale Ray runs (`ray stop`) and that /dev/shm has room.") from None
    logger.info("start-up: Ray %s in %.1f s", "joined" if cfg.ray.address else "started",
                time.perf_counter() - started)
    if ray_debugger():
        print(attach_hint(ray._private.worker.get_dashboard_url(), ray.get_runtime_context().gcs_address), flush=True)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.ray.address is None and cpus < devices:
        raise ClusterError(f"The actor needs {devices} CPU slots (trainer.nnodes x trainer.n_gpus_per_node) but "
                           f"Ray has {cpus}. Lower trainer.nnodes / trainer.n_gpus_per_node or raise ray.num_cpus.")
    return cpus


def head_address(address: str, timeout_s: float) -> str:
    """`address` (ray.address) once its head answers, within `timeout_s`: "auto" resolves to the cluster this
    machine last started (or RAY_ADDRESS). Ray's own connect would retry for minutes, printing only its internals."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    client = address.startswith("ray://")  # Ray Client: its server's port is probed the same way
    try:
        bootstrap = address.removeprefix("ray://") if client else canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as err:
        raise ClusterError(f"ray.address={address!r}: {err} Start the cluster first (launch/train_3d.sh, or `ray "
                           "start --head` on its head node), or unset ray.address for a local Ray.") from None
    host, _, port = bootstrap.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while not port_open(host, int(port), timeout_s=min(3.0, timeout_s)):
        if time.monotonic() >= deadline:
            resolved = "" if bootstrap == address else f", resolved to {bootstrap}"
            raise ClusterError(f"ray.address={address!r}{resolved}: no Ray head answered within ray.connect_timeout_s="
                               f"{timeout_s:g} s. Is the cluster up (`ray status` on its head)? Check ray.address "
                               "and the head's port, or unset ray.address for a local Ray.")
        time.sleep(1.0)
    return address


def port_open(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether `host` accepts connections on `port` (a Ray head's) within `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def device_resource() -> str:
    """The Ray resource that stands for one worker's device: "GPU" when the cluster has any (the controller may
    run on a node without one), otherwise a "CPU" slot."""
    import ray

    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


def groups_that_fit(devices: int, resource: str) -> int:
    """How many groups of `devices` x `resource`, each within one node, the alive nodes could hold (free or not)."""
    import ray

    return sum(int(node["Resources"].get(resource, 0) // devices) for node in ray.nodes() if node["Alive"])


def describe_cluster(resource: str) -> str:
    """One line on what Ray has: its alive nodes with their `resource` totals, and how much of it is free."""
    import ray

    nodes = [node for node in ray.nodes() if node["Alive"]]
    listing = ", ".join(f"{node['NodeManagerAddress']} (node {node['NodeID'][:8]}) with "
                        f"{node['Resources'].get(resource, 0):g} {resource}" for node in nodes)
    free = ray.available_resources().get(resource, 0)
    return f"Ray has {len(nodes)} alive node(s): {listing}; {free:g} {resource} free in all."
