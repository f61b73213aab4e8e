"""Command line: `python -m rl_megatron.train --config CONFIG.yaml [key=value ...]`."""
from __future__ import annotations

import argparse
import sys
import time

from rl_megatron.config import ConfigError, load_config, one_line

EPILOG = """\
examples:
  python -m rl_megatron.train --config configs/demo_cpu.yaml
  python -m rl_megatron.train --config configs/demo_cpu.yaml trainer.total_steps=5 actor.optim.lr=1e-3

Every key of rl_megatron/config/schema.py can be overridden as section.key=value.
Outputs go to <trainer.log_dir>/<trainer.experiment_name>/ (tensorboard events, metrics.jsonl, config.yaml).
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m rl_megatron.train", description="RL post-training (PPO, GRPO, RLOO, REINFORCE++) on Megatron-core + Ray + vLLM.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def report_error(err: Exception) -> int:
    """Report a problem with the input or the cluster as one `error: ...` line on stderr (no traceback)."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return report_error(err)
    from rl_megatron.checkpoint import CheckpointError
    from rl_megatron.trainer.trainer import train
    from rl_megatron.workers.cluster import ClusterError

    start = time.time()
    try:
        summary = train(cfg)
    except (ConfigError, CheckpointError, ClusterError) as err:  # found once data and checkpoints are read, or Ray starts
        return report_error(err)
    window = summary["reward_window"]
    print(f"\nDone: {summary['steps']} steps in {time.time() - start:.0f} s. Mean reward "
          f"{summary['reward_first']:.3f} (first {window} steps) -> {summary['reward_last']:.3f} (last {window} steps).")
    target = cfg.trainer.target_reward
    if target is not None:
        verdict = "reached" if summary["reward_last"] >= target else "NOT reached"
        print(f"Target mean reward {target} {verdict}.")
    print(f"Metrics: {summary['run_dir']}/metrics.jsonl; tensorboard --logdir {cfg.trainer.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
