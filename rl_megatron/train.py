"""Command line: `python -m rl_megatron.train --config CONFIG.yaml [key=value ...]`."""
from __future__ import annotations

import argparse
import os
import sys
import time

from rl_megatron.config import ConfigError, load_config

EPILOG = """\
examples:
  python -m rl_megatron.train --config configs/demo_cpu.yaml
  python -m rl_megatron.train --config configs/demo_cpu.yaml trainer.total_steps=5 actor.optim.lr=1e-3

Every key of rl_megatron/config/schema.py can be overridden as section.key=value.
Outputs go to <trainer.log_dir>/<trainer.experiment_name>/ (tensorboard events, metrics.jsonl, config.yaml).
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m rl_megatron.train", description="RL post-training (GRPO) on Megatron-core + Ray + vLLM.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def start_ray(cfg) -> int:
    """Join the configured cluster or start a local one; returns the CPUs Ray may use."""
    import ray

    if cfg.ray.address is None:
        # A local, private Ray: no usage stats, no auth token written to the home folder.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        try:
            if cfg.ray.address is None:
                ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                         object_store_memory=cfg.ray.object_store_memory, _node_ip_address="127.0.0.1",
                         log_to_driver=True)
            else:
                ray.init(address=cfg.ray.address)
        except Exception as err:
            raise SystemExit(f"error: Ray failed to start ({err}). Check that no stale Ray runs "
                             "(`ray stop`), that /dev/shm has room, or set ray.address to a running cluster.")
    cpus = int(ray.cluster_resources().get("CPU", 1))
    devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.ray.address is None and cpus < devices:
        raise SystemExit(f"error: the actor needs {devices} CPU slots (trainer.nnodes x trainer.n_gpus_per_node) "
                         f"but Ray has {cpus}. Lower trainer.n_gpus_per_node or raise ray.num_cpus.")
    return cpus


def config_error(err: ConfigError) -> int:
    """Report a configuration problem as one `error: ...` line on stderr (no traceback); exit code 2."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return config_error(err)
    from rl_megatron.trainer.loop import train

    start = time.time()
    try:
        summary = train(cfg, start_ray(cfg))
    except ConfigError as err:  # found once the model or data is opened (e.g. a task that rejects the tokenizer)
        return config_error(err)
    print(f"\nDone: {summary['steps']} steps in {time.time() - start:.0f} s. Mean reward "
          f"{summary['reward_first']:.3f} (first 5 steps) -> {summary['reward_last']:.3f} (last 5 steps).")
    target = cfg.trainer.target_reward
    if target is not None:
        verdict = "reached" if summary["reward_last"] >= target else "NOT reached"
        print(f"Target mean reward {target} {verdict}.")
    print(f"Metrics: {summary['run_dir']}/metrics.jsonl; tensorboard --logdir {cfg.trainer.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
