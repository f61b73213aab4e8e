#!/usr/bin/env bash
# Launch a training run on this node:  launch/train_3d.sh CONFIG [key=value ...]
# Uses a running Ray cluster when RAY_ADDRESS is set (ray.address=auto), a private local one otherwise.
set -euo pipefail
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  echo "usage: launch/train_3d.sh CONFIG [key=value ...]   (e.g. launch/train_3d.sh configs/demo_cpu.yaml)"
  exit 0
fi
nodes=${SLURM_NNODES:-${NNODES:-1}}
if [[ "$nodes" -gt 1 && -z "${RAY_ADDRESS:-}" ]]; then
  echo "error: $nodes nodes but no Ray cluster: start Ray on every node (ray start --head on the first," \
       "ray start --address=HEAD:6379 on the others), then run this on the head with RAY_ADDRESS=HEAD:6379." >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
[[ -x "$python" ]] || python=python3
config=$1; shift
extra=()
[[ -n "${RAY_ADDRESS:-}" ]] && extra+=("ray.address=auto")
exec "$python" -m rl_megatron.train --config "$config" "${extra[@]}" "$@"
