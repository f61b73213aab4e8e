"""This node's place in a multi-node launch, read from torchrun-style or SLURM variables, and the GPUs it has."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional

from rl_megatron.errors import LaunchError


@dataclass(frozen=True)
class NodeEnvironment:
    node_rank: int
    nnodes: int
    head_address: Optional[str]  # host of node 0 (None on a single node: this one)
    source: str  # where the values came from, for the plan
    gpus: Optional[int]  # GPUs this node offers (None: no GPU found; the run uses CPU slots)
    gpus_source: str
    gpu_memory_gib: Optional[float]  # memory of one GPU from nvidia-smi (None: not measured)


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compact node list in its simple forms: `a,b`, `node[01-04]`, `gpu[1,3-5]-ib`, and lists of
    these. (`scontrol show hostnames` is the authority; the launcher prefers it when it exists.)"""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
        if match is None:
            if "[" in item or "]" in item:
                raise LaunchError(f"SLURM_JOB_NODELIST='{nodelist}' has a form this parser does not read ('{item}'); "
                                  "run where `scontrol` exists, or set MASTER_ADDR to the first node's host name.")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            raise LaunchError(f"SLURM_JOB_NODELIST='{nodelist}': '{item}' has more than one bracket range, which this "
                              "parser does not read; run where `scontrol` exists, or set MASTER_ADDR to the first "
                              "node's host name.")
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise LaunchError(f"SLURM_JOB_NODELIST='{nodelist}': cannot read the range '{part}'; set MASTER_ADDR "
                                  "to the first node's host name.")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")  # keeps zero padding: node01
    if not hosts:
        raise LaunchError(f"SLURM_JOB_NODELIST='{nodelist}' names no host; set MASTER_ADDR to the first node's host.")
    return hosts


def _integer(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    if not value.strip().isdigit():
        raise LaunchError(f"{name}='{value}' must be a non-negative integer.")
    return int(value)


def _node_role(env: Mapping[str, str]) -> tuple[int, int, Optional[str], str]:
    """(node rank, nodes, head host, source): torchrun-style variables win over SLURM's; neither means one node."""
    if "NNODES" in env or "NODE_RANK" in env:
        nnodes, rank = _integer(env, "NNODES"), _integer(env, "NODE_RANK")
        if nnodes is None or rank is None:
            missing = "NNODES" if nnodes is None else "NODE_RANK"
            raise LaunchError(f"{missing} is not set, but the other torchrun-style variable is: set NNODES, NODE_RANK "
                              "and MASTER_ADDR on every node (or none of them, under SLURM).")
        return rank, nnodes, env.get("MASTER_ADDR") or None, "NODE_RANK/NNODES/MASTER_ADDR"
    if "SLURM_NNODES" in env:
        nnodes = _integer(env, "SLURM_NNODES")
        tasks = _integer(env, "SLURM_NTASKS") or _integer(env, "SLURM_STEP_NUM_TASKS")
        if tasks is not None and tasks != nnodes:
            raise LaunchError(f"SLURM runs {tasks} tasks on {nnodes} nodes, but the launcher must run once per node: "
                              "srun --ntasks-per-node=1 (see launch/slurm_train_3d.sbatch).")
        rank = _integer(env, "SLURM_NODEID")
        if rank is None:
            rank = _integer(env, "SLURM_PROCID")
        if rank is None:
            raise LaunchError("SLURM_NNODES is set but neither SLURM_NODEID nor SLURM_PROCID: start the launcher "
                              "with srun inside the allocation (launch/slurm_train_3d.sbatch).")
        head = env.get("MASTER_ADDR") or None
        if head is None and env.get("SLURM_JOB_NODELIST"):
            head = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        return rank, nnodes, head, "SLURM_NODEID/SLURM_NNODES/SLURM_JOB_NODELIST"
    return 0, 1, env.get("MASTER_ADDR") or None, "no NNODES/NODE_RANK or SLURM variables: one node"


def _detect_gpus(env: Mapping[str, str]) -> tuple[Optional[int], str, Optional[float]]:
    """(GPUs on this node, where that came from, GiB per GPU). GPUS_PER_NODE overrides what is found."""
    memory = None  # measured by nvidia-smi only; GPU_MEMORY_GIB overrides it in the plan
    for name in ("GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        count = _integer(env, name)
        if count is not None:
            return count, name, memory
    if env.get("CUDA_VISIBLE_DEVICES") not in (None, ""):
        visible = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
        return len(visible), "CUDA_VISIBLE_DEVICES", memory
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return None, "nvidia-smi failed", memory
        mib = [float(x) for x in out if x.replace(".", "", 1).isdigit()]
        return len(mib), "nvidia-smi", memory or (min(mib) / 1024 if mib else None)
    return None, "no GPU found (no GPUS_PER_NODE, SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES or nvidia-smi)", memory


def detect_node(env: Mapping[str, str] | None = None) -> NodeEnvironment:
    env = os.environ if env is None else env
    rank, nnodes, head, source = _node_role(env)
    gpus, gpus_source, memory = _detect_gpus(env)
    return NodeEnvironment(rank, nnodes, head, source, gpus, gpus_source, memory)
