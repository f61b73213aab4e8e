"""`python -m rl_megatron.launch COMMAND`: the planning and waiting steps of launch/train_3d.sh.

  prepare [--dry-run] [--check] CONFIG [key=value ...]
                                               check config + environment, print the plan (--dry-run: from
                                               the config and config.json alone); without
                                               --dry-run print shell assignments for the script to eval
                                               and, on the head, write the Ray token file if it is missing
                                               (--check: the head runs `rl_megatron.doctor`, not training)
  wait-cluster NODES GPUS                      (head) until that many nodes and GPUs joined Ray
  wait-head HOST PORT [--token-file PATH]      (workers) until the head is up and its token file is here
  watch-head HOST PORT                         (workers) while the head is up
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

from rl_megatron.cli import run_command
from rl_megatron.errors import ConfigError, one_line
from rl_megatron.launch.auth import RayAuth, ray_auth, write_token_file
from rl_megatron.launch.environment import LaunchError, NodeEnvironment, detect_node
from rl_megatron.planning.plan import build_plan, render_plan
from rl_megatron.preflight import load_config
from rl_megatron.preflight.dry_run import load_plan_config, shipped_name
from rl_megatron.workers.debugging import setup_problem

DEFAULT_RAY_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_DASHBOARD_HOST = "127.0.0.1"  # the dashboard and job API run code on the cluster: reach them by ssh -L
DEFAULT_JOIN_TIMEOUT_S = 600
DEFAULT_WATCH_INTERVAL_S = 10  # a worker node checks the head this often; it leaves after 3 misses in a row
# Ray's CLI from this interpreter's environment: `ray` need not be on PATH (an unactivated venv).
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if not value.isdigit():
        raise LaunchError(f"{name}='{value}' must be a positive integer (unset it for the default {default}).")
    return int(value)


@dataclass
class NodeLaunch:
    """What this node does: its role, the Ray command it runs, and (on the head) the training command."""

    node: NodeEnvironment
    head_host: str
    ray_port: int
    ray_start: list[str]
    train: list[str]
    expected_nodes: int
    expected_gpus: int
    run_dir: str
    log_file: str
    plan_text: str
    auth: RayAuth
    dashboard: Optional[str]  # host:port the head's dashboard listens on (None on the other nodes)


def check_environment(node: NodeEnvironment, nnodes: int, gpus_per_node: int, nodes_keys: str) -> None:
    """The environment's node count, node rank, head address and GPUs against what the config asks for."""
    if node.node_rank >= node.nnodes:
        raise LaunchError(f"Node rank {node.node_rank} (from {node.source}) must be below the node count "
                          f"{node.nnodes}: node ranks count from 0. Fix NODE_RANK / the SLURM allocation.")
    if node.nnodes != nnodes:
        raise LaunchError(f"The environment has {node.nnodes} node(s) (from {node.source}) but the config needs "
                          f"{nnodes} ({nodes_keys}). Set trainer.nnodes to match on the command line (e.g. "
                          f"trainer.nnodes={node.nnodes} when only the actor pool is used), or launch on {nnodes} "
                          "node(s) (NNODES / sbatch --nodes).")
    if nnodes > 1 and not node.head_address:
        raise LaunchError("MASTER_ADDR is not set: with several nodes every node must know node 0's host. Set "
                          "MASTER_ADDR, or run under SLURM (SLURM_JOB_NODELIST names it).")
    if node.gpus is not None and node.gpus < gpus_per_node:
        raise LaunchError(f"This node offers {node.gpus} GPU(s) ({node.gpus_source}) but the config places "
                          f"{gpus_per_node} per node (trainer.n_gpus_per_node, or a separate role's "
                          f"n_gpus_per_node). Set trainer.n_gpus_per_node={node.gpus} or allocate more GPUs "
                          "(sbatch --gpus-per-node).")


def plan_node(config: str, overrides: list[str], check: bool = False, dry_run: bool = False) -> NodeLaunch:
    """Load and check everything, build the plan; nothing is started. `check`: the head's command is the doctor.
    `dry_run`: check only what the plan reads (the config, the model's config.json, a shipped one where the model
    folder is not on this machine: `preflight.dry_run`); the launch checks the data and the weights."""
    node = detect_node()
    on_gpu = node.gpus is not None and node.gpus > 0
    if dry_run:
        checked = load_plan_config(config, overrides, cuda=on_gpu)
        cfg, model, notes = checked.cfg, checked.model, dry_run_notes(checked.stand_ins, checked.cfg.model.path)
    else:
        cfg = load_config(config, overrides)
        model, notes = cfg.model.path, []
    plan = build_plan(cfg, node.gpu_memory_gib, on_gpu)
    keys = " + ".join(f"{pool.nodes_key}={pool.nnodes}" for pool in plan.pools)
    check_environment(node, plan.nnodes, plan.gpus_per_node, keys)
    debugger_problem = setup_problem(starts_dashboard=node.node_rank == 0)  # RAY_DEBUG: node 0 starts the dashboard
    if debugger_problem:
        raise LaunchError(debugger_problem)
    port = _env_int("RAY_PORT", DEFAULT_RAY_PORT)
    head_host = node.head_address or "127.0.0.1"
    common = [f"--num-gpus={node.gpus or 0}", "--disable-usage-stats"]
    object_store = _env_int("RAY_OBJECT_STORE_MEMORY", None)
    if object_store is not None:
        common.append(f"--object-store-memory={object_store}")
    dashboard = None
    if node.node_rank == 0:
        dashboard_host = os.environ.get("RAY_DASHBOARD_HOST") or DEFAULT_DASHBOARD_HOST
        dashboard_port = _env_int("RAY_DASHBOARD_PORT", DEFAULT_DASHBOARD_PORT)
        dashboard = f"{dashboard_host}:{dashboard_port}"
        ray_start = [*RAY_CLI, "start", "--head", f"--port={port}", f"--dashboard-host={dashboard_host}",
                     f"--dashboard-port={dashboard_port}", *common]
    else:
        ray_start = [*RAY_CLI, "start", f"--address={head_host}:{port}", *common]
    entry = "rl_megatron.doctor" if check else "rl_megatron.train"
    train = [sys.executable, "-m", entry, "--config", config, *overrides, "ray.address=auto"]
    run_dir = cfg.trainer.run_dir
    return NodeLaunch(node, head_host, port, ray_start, train, plan.nnodes, plan.total_gpus if on_gpu else 0,
                      run_dir, os.path.join(run_dir, "logs", f"node{node.node_rank}.log"),
                      "\n".join([render_plan(plan, model), *notes]), ray_auth(os.environ, run_dir), dashboard)


def dry_run_notes(stand_ins: dict[str, str], policy_folder: str) -> list[str]:
    """What a dry run's plan leaves to the launch, and the shipped config.json files other than the policy's (which
    the plan's Model line names) that stood in for folders not on this machine."""
    notes = [f"  {path}: not on this machine; planned with {shipped_name(folder)}/config.json (shipped with "
             "rl_megatron)"
             for path, folder in stand_ins.items() if folder != policy_folder]
    return ["Dry run: read the config and the model's config.json only; the data files, the tokenizer and the "
            "weights are checked when the run launches (the same command without --dry-run, before Ray starts)."
            ] + notes


def describe_node(launch: NodeLaunch) -> str:
    node = launch.node
    role = "head (starts Ray, waits for the cluster, runs training)" if node.node_rank == 0 else \
        "worker (joins the head's Ray, waits until the run ends)"
    gpus = f"{node.gpus} GPU(s) from {node.gpus_source}" if node.gpus is not None else node.gpus_source
    lines = [f"This node: rank {node.node_rank} of {node.nnodes} ({node.source}), {role}",
             f"  head {launch.head_host}:{launch.ray_port}; {gpus}",
             f"  Ray authentication: {launch.auth.source}",
             f"  log {launch.log_file}",
             f"  would run: {shlex.join(launch.ray_start)}"]
    if node.node_rank == 0:
        port = launch.dashboard.rpartition(":")[2]
        lines += [f"  dashboard {launch.dashboard} (RAY_DASHBOARD_HOST); from your machine: "
                  f"ssh -L {port}:localhost:{port} {launch.head_host}, then http://localhost:{port}",
                  f"  then wait for {launch.expected_nodes} node(s) and {launch.expected_gpus} GPU(s) "
                  f"(RAY_JOIN_TIMEOUT={_env_int('RAY_JOIN_TIMEOUT', DEFAULT_JOIN_TIMEOUT_S)} s)",
                  f"  then: {shlex.join(launch.train)}"]
    return "\n".join(lines)


def shell_assignments(launch: NodeLaunch) -> str:
    """Bash assignments (arrays for commands) that launch/train_3d.sh evals."""
    values = {"NODE_RANK": launch.node.node_rank, "HEAD_HOST": launch.head_host, "RAY_PORT": launch.ray_port,
              "EXPECTED_NODES": launch.expected_nodes, "EXPECTED_GPUS": launch.expected_gpus,
              "JOIN_TIMEOUT": _env_int("RAY_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S),
              "RUN_DIR": launch.run_dir, "LOG_FILE": launch.log_file, "TOKEN_FILE": launch.auth.token_file or "",
              "PLAN": launch.plan_text + "\n" + describe_node(launch)}
    lines = [f"{name}={shlex.quote(str(value))}" for name, value in values.items()]
    lines += [f"RAY_CLI=({shlex.join(RAY_CLI)})", f"RAY_START=({shlex.join(launch.ray_start)})",
              f"TRAIN=({shlex.join(launch.train)})", f"RAY_ENV=({shlex.join(launch.auth.exports())})"]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="check config and environment, print the plan")
    prepare.add_argument("--dry-run", action="store_true", help="print the plan and the commands, start nothing")
    prepare.add_argument("--check", action="store_true", help="the head runs python -m rl_megatron.doctor instead "
                                                               "of training, once every node has joined")
    prepare.add_argument("config")
    prepare.add_argument("overrides", nargs="*", metavar="key=value")
    cluster = commands.add_parser("wait-cluster", help="(head) wait until the nodes and GPUs joined Ray")
    cluster.add_argument("nodes", type=int)
    cluster.add_argument("gpus", type=int)
    for name, text in (("wait-head", "(worker) wait until the head's Ray port is up"),
                       ("watch-head", "(worker) block while the head's Ray port is up")):
        command = commands.add_parser(name, help=text)
        command.add_argument("host")
        command.add_argument("port", type=int)
        if name == "wait-head":
            command.add_argument("--token-file", help="and until node 0's Ray token file can be read here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _run(args), ConfigError, LaunchError, message=one_line)


def _run(args) -> None:
    from rl_megatron.launch import ray_cluster

    if args.command == "prepare":
        launch = plan_node(args.config, args.overrides, args.check, dry_run=args.dry_run)
        if args.dry_run:
            print(launch.plan_text + "\n" + describe_node(launch) + "\nDry run: nothing was started.")
        else:  # the script prints PLAN once its per-node log is open
            if launch.node.node_rank == 0 and launch.auth.token_file:
                write_token_file(launch.auth.token_file)  # before `ray start --head`, which needs it
            print(shell_assignments(launch))
    elif args.command == "wait-cluster":
        timeout = _env_int("RAY_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S)
        print(ray_cluster.wait_for_cluster("auto", args.nodes, args.gpus, timeout), file=sys.stderr)
    elif args.command == "wait-head":
        ray_cluster.wait_for_head(args.host, args.port, _env_int("RAY_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S),
                                  token_file=args.token_file)
    else:
        ray_cluster.watch_head(args.host, args.port, _env_int("RAY_WATCH_INTERVAL", DEFAULT_WATCH_INTERVAL_S))


if __name__ == "__main__":
    sys.exit(main())
