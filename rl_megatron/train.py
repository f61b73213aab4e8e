"""Command line: `python -m rl_megatron.train --config CONFIG.yaml [key=value ...]`."""
from __future__ import annotations

import argparse
import sys
import time

import psutil

from rl_megatron.cli import run_command
from rl_megatron.config.describe import describe_config, render
from rl_megatron.config.extensions import extension_sections
from rl_megatron.errors import ConfigError, one_line
from rl_megatron.platform.startup import defer_garbage_collection
from rl_megatron.preflight import load_config
from rl_megatron.preflight.resolve import EXTENSIBLE

EPILOG = """\
examples:
  python -m rl_megatron.train --config configs/demo_cpu.yaml
  python -m rl_megatron.train --config configs/demo_cpu.yaml trainer.total_steps=5 actor.optim.lr=1e-3
  python -m rl_megatron.train --config configs/demo_cpu.yaml 'trainer.logger=[console,tensorboard,wandb]'
  python -m rl_megatron.train --config configs/demo_cpu.yaml trainer.profile_steps=[3] trainer.total_steps=4
  python -m rl_megatron.train --config configs/demo_cpu.yaml trainer.val_only=true   # validate the last checkpoint
  python -m rl_megatron.train --config CONFIG trainer.deterministic=true   # bitwise-reproducible GPU training (slower)
  RAY_DEBUG=legacy python -m rl_megatron.train --config ...   # breakpoint() in a worker; attach with `ray debug`

Every config key can be overridden as section.key=value; --help SECTION lists a section's keys (e.g. --help rollout),
with their types, defaults and descriptions.
Outputs go to <trainer.log_dir>/<trainer.experiment_name>/: config.yaml, metrics.jsonl and tensorboard events (as
trainer.logger says), logs/ (each worker's output, the controller's records), validation/, checkpoints/, profile/.
Exit codes: 0 done, 2 bad input (config, data, model, checkpoint, cluster), 3 a worker process died (the same
command resumes from the last checkpoint).
"""


WORKER_DIED = 3  # exit code when a worker process died (2: bad input)


class ConfigHelp(argparse.Action):
    """-h/--help [SECTION]: the usage, then every config key (of SECTION alone: rollout, actor.optim, actor.clip_cov)
    with its type, default and description; the built-in extensions' own keys among them."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, metavar="SECTION",
                         help="show this help and the config's keys (of SECTION only, e.g. rollout), then exit")

    def __call__(self, parser, namespace, section, option_string=None):
        every = describe_config({name: cls for name, (_, _, cls) in extension_sections(EXTENSIBLE).items()})
        keys = [key for key in every if section is None or key.key.startswith(section + ".")]
        if not keys:
            parser.exit(2, f"error: --help {section}: no such config section; the sections are "
                           f"{', '.join(dict.fromkeys(key.key.split('.')[0] for key in every))} and theirs "
                           "(e.g. actor.optim)\n")
        parser.print_help()
        print(f"\nconfig keys{' of ' + section if section else ''} (section.key: type = default):")
        print(render(keys))
        parser.exit()


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m rl_megatron.train", description="RL post-training (PPO, GRPO, RLOO, REINFORCE++) on Megatron-core + Ray + vLLM.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("-h", "--help", action=ConfigHelp)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    defer_garbage_collection()  # until the workers are up (the trainer calls startup_done)
    # A config error is reported before the trainer (Ray, Megatron, vLLM) is even imported.
    return run_command(lambda: _train(load_config(args.config, args.overrides)), ConfigError, message=one_line)


def _train(cfg) -> int:
    from rl_megatron.checkpoint import CheckpointError
    from rl_megatron.checkpoint.run import resume_hint
    from rl_megatron.trainer.trainer import train
    from rl_megatron.workers.cluster import ClusterError
    from rl_megatron.workers.failures import WorkerDied

    try:
        # Found once data and checkpoints are read, or Ray starts (a ConfigError goes to main's runner).
        return run_command(lambda: _report(cfg, train(cfg)), CheckpointError, ClusterError, message=one_line)
    except WorkerDied as err:  # not the input's fault: a distinct exit code, and what running again does
        print(f"error: {err}\n{resume_hint(cfg)}", file=sys.stderr)
        return WORKER_DIED


def _report(cfg, summary) -> int:
    window, training_s = summary.reward_window, time.time() - summary.training_started
    # Start-up counts from this process's start: imports, reading the input, Ray, the workers, the first sync.
    startup_s = summary.training_started - psutil.Process().create_time()
    if cfg.trainer.val_only:
        validation = summary.validation
        print(f"\nValidated {len(validation.generations)} samples in {training_s:.0f} s, after {startup_s:.0f} s of "
              "start-up: " + ", ".join(f"{name}={value:.3f}" for name, value in validation.metrics.items()))
        print(f"Every sample with its score: {summary.validation_path}")
    elif summary.resumed_at and summary.steps == summary.resumed_at:
        print(f"Nothing to do: the checkpoint at step {summary.resumed_at} already finished this run "
              "(trainer.total_steps or trainer.target_reward); raise trainer.total_steps to go on.")
    else:
        trained = f"steps {summary.resumed_at + 1}-{summary.steps}" if summary.resumed_at else f"{summary.steps} steps"
        print(f"\nDone: {trained} in {training_s:.0f} s, after {startup_s:.0f} s of start-up. Mean reward "
              f"{summary.reward_first:.3f} (first {window} steps) -> {summary.reward_last:.3f} (last {window} steps).")
        target = cfg.trainer.target_reward
        if target is not None:
            verdict = "reached" if summary.reward_last >= target else "NOT reached"
            print(f"Target mean reward {target} {verdict}.")
    print(f"Metrics: {where_metrics_are(cfg, summary.run_dir)}")
    return 0


def where_metrics_are(cfg, run_dir: str) -> str:
    """Where the loggers of trainer.logger put the run's metrics, and how to look at them."""
    places = {"jsonl": f"{run_dir}/metrics.jsonl", "tensorboard": f"tensorboard --logdir {cfg.trainer.log_dir}",
              "wandb": f"wandb (project {cfg.trainer.project_name}, run {cfg.trainer.experiment_name})",
              "mlflow": f"mlflow (experiment {cfg.trainer.project_name}, run {cfg.trainer.experiment_name})"}
    return "; ".join(places[name] for name in dict.fromkeys(cfg.trainer.logger) if name in places) or "not recorded"


if __name__ == "__main__":
    sys.exit(main())
