"""Command line: `python -m rl_megatron.doctor --config CONFIG.yaml [key=value ...] [--json]`."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from rl_megatron.cli import run_command
from rl_megatron.doctor import checks
from rl_megatron.doctor.report import FAIL, PASS, Result, exit_code, guarded, table
from rl_megatron.errors import ConfigError, one_line
from rl_megatron.preflight import load_config

EPILOG = """\
checks (each PASS, FAIL with the fix, or SKIP with the reason):
  devices      this machine's GPUs (CPU slots without CUDA) against the config's pools
  stack        torch is the build vLLM is linked against (SKIP without vLLM); Transformer Engine imports (GPU);
               the MoE router of the config's family runs (on TE's GEMM, or torch's without TE)
  one device, no Ray or vLLM needed (a tiny model of the config's family with random weights, in one process):
    Megatron vs transformers (FAMILY)  log-probs and entropy against transformers', every weight exported bitwise
    update                             one optimizer step moves the log-probs with the advantages
    offload round trip                 the trainer's state to the host and back bitwise, the next update unchanged
    bench train                        `python -m rl_megatron.bench train`: tokens/s and MFU of training steps
  collectives  all-reduce and the weight sync's batched exchange: bandwidth (NCCL on GPU, gloo on CPU); SKIP on
               one device
  host memory  what waits in host memory between phases, against free memory and /dev/shm
  GPU memory   the dry-run memory plan per GPU against this machine's GPUs
  cycle        a tiny model through the real workers at the config's rollout placement and TP: sync, every engine
               byte checked, greedy generation equal to transformers', an update, and again (SKIP without Ray
               and vLLM)

exit code: 0 when every applicable check passed, 1 when one failed, 2 for a bad config.
examples:
  python -m rl_megatron.doctor --config configs/demo_cpu.yaml
  python -m rl_megatron.doctor --config configs/demo_cpu.yaml trainer.n_gpus_per_node=1 \\
      actor.tensor_model_parallel_size=1                               # one device; Ray and vLLM not needed
  launch/train_3d.sh --check configs/grpo_qwen2_5_7b_gsm8k.yaml      # on a cluster, once every node has joined
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.doctor", epilog=EPILOG,
                                     description="Check every path a run takes on this machine's devices, in about "
                                                 "two minutes, before a long job is queued.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the YAML config the run will use (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    return parser.parse_args(argv)


def cycle(cfg) -> Result:
    """A tiny model built here (no download) through the real workers and engines (SKIP without Ray and vLLM)."""
    skipped = checks.needs_engines("cycle", checks.missing_modules(checks.ENGINE_MODULES))
    if skipped:
        return skipped
    # They import Ray and vLLM: only here, so that the other checks run where those are not installed.
    from rl_megatron.doctor.cycle import cycle_config, weight_cycle
    from rl_megatron.models.tiny import write_tiny_model
    from rl_megatron.workers.cluster import start_ray

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rl_megatron-doctor-") as folder:
        tiny = cycle_config(cfg, write_tiny_model(folder, with_weights=True, seed=0))
        report = weight_cycle(tiny, start_ray(tiny))
    figure = (f"{report.engines} engine worker(s), rollout TP={tiny.rollout.tensor_parallel_size} "
              f"({tiny.rollout.placement}), actor TP={tiny.actor.tensor_model_parallel_size}: "
              f"{time.perf_counter() - start:.0f} s; engine vs trainer log-probs within {report.max_log_prob_gap:.1e}")
    if report.problems:
        return Result("cycle", FAIL, figure, "; ".join(report.problems) + " (see docs/architecture.md, Resharding)")
    return Result("cycle", PASS, figure)


def diagnose(cfg) -> list[Result]:
    results = [checks.devices(cfg)]
    if results[0].status != PASS:  # nothing further can run in the config's shape
        return results
    results += guarded("stack", checks.stack)
    results += guarded("Megatron on one device", lambda: checks.megatron(cfg))
    results += guarded("collectives", lambda: checks.collectives(cfg))
    results += guarded("host memory", lambda: checks.host_memory(cfg))
    results += guarded("GPU memory", lambda: checks.gpu_memory(cfg))
    if not any(r.status == FAIL and r.name.startswith("stack") for r in results):
        results += guarded("cycle", lambda: cycle(cfg))
    return results


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        cfg = load_config(args.config, args.overrides)
        start = time.perf_counter()
        results = diagnose(cfg)
        if args.json:
            print(json.dumps([r.as_dict() for r in results], indent=2))
        else:
            print(table(results))
            failed = sum(r.status == FAIL for r in results)
            print(f"\n{'All applicable checks passed' if not failed else f'{failed} check(s) failed'} "
                  f"in {time.perf_counter() - start:.0f} s.")
        return exit_code(results)

    return run_command(body, ConfigError, message=one_line)


if __name__ == "__main__":
    sys.exit(main())
