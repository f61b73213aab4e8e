#!/usr/bin/env bash
# One launcher for every node of a multi-node run (torchrun-style variables or SLURM); see --help.
# Python (python -m rl_megatron.launch) checks and plans; this script detects the head, starts/stops Ray, runs.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/train_3d.sh [--dry-run | --check] CONFIG [key=value ...]

Run the same command on every node. Node 0 starts the Ray head, waits for all nodes and GPUs, then runs
`python -m rl_megatron.train --config CONFIG key=value ... ray.address=auto`; the other nodes join it and
wait until the run ends. Cluster shape: trainer.nnodes x trainer.n_gpus_per_node (override them here).

Role of this node, from (first match):
  NODE_RANK, NNODES, MASTER_ADDR                      torchrun style, set on each node
  SLURM_NODEID/SLURM_PROCID, SLURM_NNODES,
  SLURM_JOB_NODELIST (first host = head)              under srun, one task per node (slurm_train_3d.sbatch)
  nothing                                             a single node
Settings (environment): RAY_PORT (6379), RAY_DASHBOARD_PORT (8265), RAY_DASHBOARD_HOST (127.0.0.1: reach the
dashboard with `ssh -L 8265:localhost:8265 HEAD`), RAY_OBJECT_STORE_MEMORY (bytes; Ray's default),
RAY_JOIN_TIMEOUT (600 s), RAY_WATCH_INTERVAL (10 s: how often the other nodes check that the head is up; they
leave after 3 misses), GPUS_PER_NODE (default: SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES or nvidia-smi),
GPU_MEMORY_GIB (default: nvidia-smi, else 80), PYTHON (default: .venv/bin/python, else python3),
RAY_DEBUG=1 or legacy (Ray's debugger: a worker's breakpoint() pauses it; set it on every node, srun passes it
on; see docs/watching-and-debugging.md, "Debugging"), RAY_DEBUG_POST_MORTEM=1 (pause a worker where it raised).

Ray authentication (token) is on: only processes holding the cluster's token can use it. The token comes from
  RAY_AUTH_TOKEN                                      the same value in every node's environment, or
  RAY_AUTH_TOKEN_PATH                                 a file every node can read, or by default
  <trainer.log_dir>/<trainer.experiment_name>/ray_auth_token
Node 0 writes a new token (mode 0600) to the file if it is missing; the other nodes wait until they can read it,
so the file must be on storage every node shares. RAY_AUTH_MODE=disabled turns authentication off: insecure,
anyone who can reach the head's Ray ports can then run code on every node.

  --dry-run   check the config against this environment and print the plan (nodes, GPUs per role,
              TP/PP/EP/DP, memory per GPU) and the commands; starts nothing. Reads only the config and the
              model's config.json (where model.path is not on this machine, the one configs/models/<name>
              ships for that folder name); the data, tokenizer and weights are checked by the launch
  --check     start the cluster as for a run, then node 0 runs `python -m rl_megatron.doctor` (devices, stack,
              NCCL bandwidth, memory, a tiny model through the real workers) instead of training; exit code 0
              when every check passed
Logs: <trainer.log_dir>/<trainer.experiment_name>/logs/node<rank>.log
SIGTERM or Ctrl-C on node 0: the trainer finishes its step, saves a checkpoint and exits (a second Ctrl-C aborts);
running the same command again resumes from it (trainer.resume=auto).
EOF
}

dry_run=() check=()
case "${1:-}" in
  -h|--help|"") usage; exit 0 ;;
  --dry-run) dry_run=(--dry-run); shift ;;
  --check) check=(--check); shift ;;
esac
[[ $# -ge 1 ]] || { usage >&2; exit 2; }

cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[[ -x "$python" ]] || python=python3

# The head is the allocation's first host; scontrol knows every nodelist syntax (Python parses simple ones).
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  export MASTER_ADDR
fi

if [[ ${#dry_run[@]} -gt 0 ]]; then
  exec "$python" -m rl_megatron.launch prepare --dry-run "${check[@]}" "$@"
fi

# Every check runs here, before Ray starts; a failure exits with the message from Python.
assignments=$("$python" -m rl_megatron.launch prepare "${check[@]}" "$@")
# These are set by the eval below (shell-quoted by Python).
NODE_RANK='' HEAD_HOST='' RAY_PORT='' EXPECTED_NODES='' EXPECTED_GPUS='' JOIN_TIMEOUT='' LOG_FILE='' TOKEN_FILE=''
PLAN='' RAY_CLI=() RAY_START=() TRAIN=() RAY_ENV=()
eval "$assignments"
# RAY_ENV: Ray's authentication mode and token file, for every Ray command here and the trainer.
export RAY_JOIN_TIMEOUT=$JOIN_TIMEOUT "${RAY_ENV[@]}"

mkdir -p "$(dirname "$LOG_FILE")"
exec > >(tee -a "$LOG_FILE") 2>&1
echo "$PLAN"

ray_started=0
cleanup() {
  if [[ $ray_started -eq 1 ]]; then
    echo "node $NODE_RANK: stopping Ray"
    "${RAY_CLI[@]}" stop --force >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ $NODE_RANK -eq 0 ]]; then
  ray_started=1
  "${RAY_START[@]}"
  "$python" -m rl_megatron.launch wait-cluster "$EXPECTED_NODES" "$EXPECTED_GPUS"
  # SIGTERM and Ctrl-C reach the trainer once, through this launcher: the trainer (its own process group, set -m)
  # finishes its step, saves a checkpoint and exits; Ray stops after that. A second Ctrl-C aborts.
  set -m
  "${TRAIN[@]}" &
  train_pid=$!
  set +m
  trap 'echo "node 0: SIGTERM: the trainer saves and stops"; kill -TERM $train_pid' TERM
  trap 'kill -INT $train_pid' INT
  while true; do
    status=0
    wait "$train_pid" || status=$?
    kill -0 "$train_pid" 2>/dev/null || break  # wait also returns when a trap ran: wait again
  done
  echo "node 0: training exited with status $status"
  exit "$status"
fi

# The other nodes' Ray must outlive a SIGTERM while node 0 saves: they leave when the head's run ends.
trap 'echo "node $NODE_RANK: SIGTERM: staying up until node 0 has saved and ended"' TERM

"$python" -m rl_megatron.launch wait-head "$HEAD_HOST" "$RAY_PORT" ${TOKEN_FILE:+--token-file "$TOKEN_FILE"}
# The head's port can answer before its GCS accepts nodes: retry the join a few times.
for attempt in 1 2 3 4 5; do
  if "${RAY_START[@]}"; then ray_started=1; break; fi
  if [[ $attempt -eq 5 ]]; then
    echo "error: node $NODE_RANK could not join the Ray head $HEAD_HOST:$RAY_PORT (see above)" >&2
    exit 1
  fi
  sleep 10
done
echo "node $NODE_RANK: joined $HEAD_HOST:$RAY_PORT; waiting for the run on node 0 to end"
"$python" -m rl_megatron.launch watch-head "$HEAD_HOST" "$RAY_PORT"
