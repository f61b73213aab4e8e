"""`launch/train_3d.sh` as users run it: --dry-run under torchrun-style and SLURM variables prints the plan;
a node count or layout that does not fit fails before Ray starts, naming the key and the fix; and the real
thing, two nodes on this machine: Ray head and join with token authentication, the wait for the cluster,
training, and Ray's stop."""
import os
import stat
import subprocess
import sys
import threading

import pytest
from helpers.runs import REPO

CLUSTER = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor.tensor_model_parallel_size=2",
           "actor.pipeline_model_parallel_size=2", "actor.micro_batch_size=4", "model.dtype=bfloat16"]
LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "GPUS_PER_NODE", "GPU_MEMORY_GIB", "CUDA_VISIBLE_DEVICES",
                    "RAY_PORT", "RAY_ADDRESS", "RAY_DASHBOARD_PORT", "RAY_DASHBOARD_HOST", "RAY_JOIN_TIMEOUT",
                    "RAY_WATCH_INTERVAL", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# A new driver's ray.init(address) against the running cluster, in a process of its own.
PROBE = """import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
except ConnectionError as err:
    print("refused:", err)
else:
    print("connected:", sum(node["Alive"] for node in ray.nodes()), "nodes")
"""


def as_node(cmd: list[str]) -> list[str]:
    """`cmd` as a node of its own: in PID and mount namespaces of its own (util-linux unshare; in a user namespace
    too where the tests do not run as root), with its own process table, where the launcher's `ray stop` ends its
    own node's Ray only, not the Ray of the suite's other runs on this machine (it kills every Ray process it sees),
    and its own /dev/shm, as a machine has (the trainer sweeps files there of processes it does not see). Killing
    unshare kills the node."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
            'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"', "node", *cmd]


def launch(tmp_path, env, *args, timeout=60, wait=True):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    clean.update(env, PYTHON=sys.executable)
    cmd = as_node(["launch/train_3d.sh", *args[:-1], "configs/demo_cpu.yaml", f"trainer.log_dir={tmp_path}",
                   *args[-1]])
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, env=clean, capture_output=True, text=True, timeout=timeout)


def connect(address, env):
    """PROBE with `env` as its only Ray authentication variables (tests/conftest.py sets RAY_AUTH_MODE)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.Popen([sys.executable, "-c", PROBE, address], env=dict(clean, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_help():
    done = subprocess.run(["launch/train_3d.sh", "--help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--dry-run" in done.stdout and "SLURM_JOB_NODELIST" in done.stdout


def test_dry_run_torchrun_style_worker(tmp_path):
    done = launch(tmp_path, {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "head-host", "GPUS_PER_NODE": "8",
                             "RAY_PORT": "6400"}, "--dry-run", CLUSTER)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "nodes 0-1: actor pool, 2 x 8 = 16 GPUs" in out
    assert "TP=2 PP=2 CP=1 EP=1 DP=4" in out and "TP=1, 16 engines" in out
    assert "PP stage = 8 GPUs = 1 node(s), stages in node order" in out
    assert "Memory per GPU" in out and "rollout.gpu_memory_utilization=0.5 x 80 GiB" in out
    assert "rank 1 of 2 (NODE_RANK/NNODES/MASTER_ADDR), worker" in out
    assert "start --address=head-host:6400 --num-gpus=8" in out
    assert f"Ray authentication: token file {tmp_path}/demo_cpu/ray_auth_token (in the run directory" in out
    assert f"{tmp_path}/demo_cpu/logs/node1.log" in out and not os.path.exists(tmp_path / "demo_cpu")


def test_dry_run_slurm_head(tmp_path):
    env = {"SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8", "GPU_MEMORY_GIB": "141",
           "RAY_AUTH_TOKEN": "secret-from-the-environment",
           "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}  # no scontrol: Python reads the nodelist
    done = launch(tmp_path, env, "--dry-run", CLUSTER)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "rank 0 of 2 (SLURM_NODEID/SLURM_NNODES/SLURM_JOB_NODELIST), head" in out
    assert "head gpu07:6379" in out and "start --head --port=6379 --dashboard-host=127.0.0.1" in out
    assert "ssh -L 8265:localhost:8265 gpu07" in out
    assert "Ray authentication: token from RAY_AUTH_TOKEN" in out and "secret-from-the-environment" not in out
    assert "then wait for 2 node(s) and 16 GPU(s)" in out and "of 141 GiB (GPU_MEMORY_GIB)" in out
    assert "-m rl_megatron.train --config configs/demo_cpu.yaml" in out and "ray.address=auto" in out


@pytest.mark.parametrize("env, overrides, expected", [
    ({"NNODES": "3", "NODE_RANK": "0", "MASTER_ADDR": "h0"}, CLUSTER, "trainer.nnodes=2"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h0"}, CLUSTER, "must be below the node count 2"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h0", "GPUS_PER_NODE": "4"}, CLUSTER,
     "Set trainer.n_gpus_per_node=4"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h0"}, CLUSTER[:1] + ["trainer.n_gpus_per_node=1"],
     "actor.tensor_model_parallel_size=2 does not fit"),
    ({}, CLUSTER[1:3] + ["actor.micro_batch_size=64"], "data-parallel size 4 x actor.micro_batch_size=64"),
])
def test_bad_cluster_fails_before_ray_starts(tmp_path, env, overrides, expected):
    """Without --dry-run too: the checks run before `ray start`, so no node log is even opened."""
    done = launch(tmp_path, env, overrides)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and expected in done.stderr, done.stderr
    assert "ray" not in done.stdout.lower() and not os.path.exists(tmp_path / "demo_cpu")


def test_two_nodes_on_this_machine_start_join_train_and_stop(tmp_path):
    """Node 1 waits for the head and joins its Ray; node 0 starts the head, waits for both nodes, trains, saves
    and stops Ray; node 1 then leaves. (Each node is a PID namespace of its own: `as_node`.) Token
    authentication is on: node 0 writes the token to the run directory (0600), which node 1 shares, as nodes
    on shared storage do; while node 0 trains, a driver without the token is refused and one with it connects."""
    from rl_megatron.workers.distributed import free_ports

    ray_port, dashboard_port = free_ports(2)
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "RAY_PORT": str(ray_port),
           "RAY_DASHBOARD_PORT": str(dashboard_port), "RAY_JOIN_TIMEOUT": "120", "RAY_WATCH_INTERVAL": "1"}
    overrides = ["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1",
                 "trainer.total_steps=1", "trainer.progress_bar=false"]
    token_file, address = tmp_path / "demo_cpu" / "ray_auth_token", f"127.0.0.1:{ray_port}"
    worker = launch(tmp_path, dict(env, NODE_RANK="1"), overrides, wait=False)
    head = launch(tmp_path, dict(env, NODE_RANK="0"), overrides, wait=False)
    watchdog = threading.Timer(300, head.kill)  # a hung head fails the test instead of blocking it
    watchdog.start()
    try:
        head_output = ""
        for line in head.stdout:  # until both nodes joined: the probes run while node 0 trains
            head_output += line
            if "joined the Ray cluster" in line:
                break
        # Without the token (Ray's default client), with one connection attempt instead of Ray's 20 s of retries;
        # with the token file, as the README tells users to connect their own drivers.
        probes = [connect(address, {"RAY_gcs_server_port_wait_time_s": "1"}),
                  connect(address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})]
        without_token, with_token = (probe.communicate(timeout=60)[0] for probe in probes)
        head_output += head.communicate(timeout=300)[0]
        worker_output, _ = worker.communicate(timeout=60)  # it leaves once the head's port stops answering
    finally:
        watchdog.cancel()
        head.kill()
        worker.kill()
    assert head.returncode == 0, head_output
    assert "2 nodes and 0 GPUs joined the Ray cluster" in head_output  # waited for node 1
    assert "node 0: training exited with status 0" in head_output
    assert "step 1: checkpoint saved" in head_output and "node 0: stopping Ray" in head_output
    assert worker.returncode == 0, worker_output
    assert f"node 1: joined 127.0.0.1:{ray_port}" in worker_output and "node 1: stopping Ray" in worker_output
    assert "refused:" in without_token and "Unauthenticated" in without_token, without_token
    assert "connected: 2 nodes" in with_token, with_token
    assert f"Ray authentication: token file {token_file}" in head_output and "--dashboard-host=127.0.0.1" in head_output
    token = token_file.read_text()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token) == 64
    logs = tmp_path / "demo_cpu" / "logs"
    node_logs = [(logs / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert "training exited with status 0" in node_logs[0] and "joined" in node_logs[1]
    assert not any(token in text for text in (head_output, worker_output, *node_logs))
    assert (tmp_path / "demo_cpu" / "metrics.jsonl").read_text().count('"step": 1') == 1


def test_check_starts_the_cluster_and_runs_the_doctor_on_the_head(tmp_path):
    """`--check` on one node: Ray's head starts, node 0 runs the doctor against it instead of training (every check
    that applies on CPU passes, the GPU-only ones say why they skip), and Ray stops."""
    from rl_megatron.workers.distributed import free_ports

    ray_port, dashboard_port = free_ports(2)
    # How long it takes is a benchmark (docs/benchmarks.md), not asserted: on a loaded machine a wall-clock bound
    # failed (204 s against 180) with every check passing.
    done = launch(tmp_path, {"RAY_PORT": str(ray_port), "RAY_DASHBOARD_PORT": str(dashboard_port)}, "--check", [],
                  timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split("  ")[1].strip(): line.split()[0] for line in done.stdout.splitlines()
             if line.split() and line.split()[0] in ("PASS", "FAIL", "SKIP")}
    assert lines == {"devices": "PASS", "stack: torch and vLLM": "PASS", "stack: Transformer Engine": "SKIP",
                     "stack: MoE router": "SKIP", "Megatron vs transformers (qwen2)": "PASS", "update": "PASS",
                     "offload round trip": "PASS", "bench train": "PASS",
                     "collectives: all-reduce (gloo)": "PASS", "collectives: batched exchange (gloo)": "PASS",
                     "host memory": "PASS", "GPU memory": "SKIP", "cycle": "PASS"}, done.stdout
    # the reasons for the skips
    assert "needs CUDA" in done.stdout and "no CUDA" in done.stdout and "qwen2 is dense" in done.stdout
    assert "All applicable checks passed" in done.stdout and "training exited with status 0" in done.stdout
    assert "node 0: stopping Ray" in done.stdout
