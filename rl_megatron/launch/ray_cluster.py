"""Waiting for a multi-node Ray cluster: the head waits for every node and GPU, the workers for the head."""
from __future__ import annotations

import os
import time
from typing import Optional

from rl_megatron.launch.environment import LaunchError
from rl_megatron.workers.cluster import port_open


def cluster_shortfall(nodes: list[dict], expected_nodes: int, expected_gpus: int) -> Optional[str]:
    """What the cluster (`ray.nodes()`) still lacks, in words; None once every node and GPU has joined."""
    alive = [n for n in nodes if n.get("Alive")]
    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in alive))
    if len(alive) >= expected_nodes and gpus >= expected_gpus:
        return None
    hosts = ", ".join(sorted(n.get("NodeManagerAddress", "?") for n in alive)) or "none"
    return (f"{len(alive)} of {expected_nodes} nodes and {gpus} of {expected_gpus} GPUs have joined "
            f"(joined: {hosts})")


def wait_for_cluster(address: str, expected_nodes: int, expected_gpus: int, timeout_s: float,
                     poll_s: float = 5.0) -> str:
    """Block until the Ray cluster at `address` has the nodes and GPUs; LaunchError naming the shortfall."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            shortfall = cluster_shortfall(ray.nodes(), expected_nodes, expected_gpus)
            if shortfall is None:
                return f"{expected_nodes} nodes and {expected_gpus} GPUs joined the Ray cluster"
            if time.monotonic() >= deadline:
                raise LaunchError(f"After {timeout_s:g} s (RAY_JOIN_TIMEOUT), {shortfall}. Check the missing nodes' "
                                  "logs (runs/<experiment>/logs/node<rank>.log): did the launcher start there, can "
                                  "they reach the head's RAY_PORT, do they see their GPUs?")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def _holds_token(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def wait_for_head(host: str, port: int, timeout_s: float, poll_s: float = 2.0,
                  token_file: Optional[str] = None) -> None:
    """Block until the head's Ray port accepts connections (the head node may start later than this one) and, with
    a `token_file`, until node 0's token can be read here: shared file systems can show a new file late."""
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port):
        if time.monotonic() >= deadline:
            raise LaunchError(f"The Ray head {host}:{port} did not come up within {timeout_s:g} s (RAY_JOIN_TIMEOUT). "
                              "Check node 0's log, MASTER_ADDR / the first host of SLURM_JOB_NODELIST, and RAY_PORT.")
        time.sleep(poll_s)
    while token_file and not _holds_token(token_file):
        if time.monotonic() >= deadline:
            raise LaunchError(f"The Ray head {host}:{port} is up, but its token file {token_file} is missing or empty "
                              f"on this node after {timeout_s:g} s (RAY_JOIN_TIMEOUT): node 0 writes it, so it must be "
                              "on storage every node shares. Put trainer.log_dir there, or set RAY_AUTH_TOKEN_PATH to "
                              "a file there, or RAY_AUTH_TOKEN to the same token on every node.")
        time.sleep(poll_s)


def watch_head(host: str, port: int, poll_s: float = 10.0, misses_allowed: int = 3) -> None:
    """Block while the head's Ray port answers: a worker node lives as long as the run on the head."""
    misses = 0
    while misses < misses_allowed:  # a few misses in a row, so that one dropped connection does not end the node
        misses = 0 if port_open(host, port) else misses + 1
        time.sleep(poll_s)
