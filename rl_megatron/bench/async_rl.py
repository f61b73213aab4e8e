"""`python -m rl_megatron.bench async --json`: one-step-off asynchronous RL (`trainer.async_mode=one_step_off`: a
generation thread generates batch k + 1 on the vLLM engines while the trainer trains on batch k) against
synchronous RL (generate, then train), and streaming (`trainer.async_mode=streaming`: prompt groups admitted as the
engines free up, each batch the first groups done) against one-step-off, on the same engines, as real training runs
(both asynchronous modes at trainer.rollout_staleness = `--staleness`, default 1).

The workload: the trainer itself (`python -m rl_megatron.train`), run three times as a subprocess with the same config,
each in a temporary log directory: the CPU demo (configs/demo_cpu.yaml: GRPO on a tiny random-initialised Qwen2,
32 prompts x 8 samples a step) at one trainer process (TP=1) and one vLLM engine in a process of its own
(`rollout.placement=separate`, which one-step-off needs), `--steps` steps (default 8), responses of up to
`--max-tokens` tokens (default 64). The random model stops at its end token at random, so response lengths are
long-tailed (roughly geometric, cut at --max-tokens): `response_length_mean`/`response_length_max` per mode show the
tail. The figures come from each run's metrics.jsonl (`timing_s/*`), over the steady steps: step 1 (the engine's
warm-up, and in one-step-off a batch with nothing before it to hide behind) and the last step (one-step-off generates
nothing beside it: on shared cores it trains uncontended, faster than any steady step) are left out of every mode.

`--repeats R` (default 1) runs the three modes R times, interleaved (synchronous, one-step-off, streaming, then again),
so that a machine whose speed drifts (a shared VM) slows each mode's runs alike: each mode reports its run of median
samples/s (`samples_per_s_by_repeat`: all of them), and `streaming_vs_one_step_off_by_repeat` pairs each repeat's
one-step-off and streaming runs, which ran one after the other.

Per mode (`modes.synchronous`, `modes.one_step_off`, `modes.streaming`), means over those steps:
- `step_s`: `timing_s/step`, the trainer's step (taking the batch, the forward passes, the update, the weight sync);
- `gen_s`: `timing_s/gen`, generating the step's batch: in the step when synchronous; one-step-off, in the
  generation thread, mostly during the step before;
- `train_s`: the trainer's busy time: step - gen when synchronous, step - wait_for_rollout one-step-off;
- `wait_for_rollout_share`: the share of the step the trainer waits for the engines: one-step-off
  `timing_s/wait_for_rollout` / step (waiting for the batch, and at the weight sync for the batch being generated to
  end); synchronous, gen / step (the trainer idles through the whole generation; no metric, derived);
- `wait_for_train_share`: the share of the step the engines sit idle waiting for the trainer: one-step-off
  `timing_s/wait_for_train` / step (between the end of one batch and the start of the next); synchronous,
  train / step (derived: the engines idle through the whole training);
- `overlap`: the share of the generation hidden behind training, (gen - wait_for_rollout) / gen clamped to [0, 1],
  over the whole run, each batch's generation against the trainer's waits for it (0 when synchronous: nothing is
  hidden). Summed over every step, not the steady ones: step k's wait is its take of batch k plus its sync's wait
  for batch k + 1 (rl_megatron/trainer/rollout_ahead.py), so only the run's sums pair each batch with its own waits;
  one step's wait set against another batch's generation (long-tailed: their lengths differ) read 0 where batches
  overlapped. The first batch, which nothing hides, is counted;
- `response_length_mean` (mean of the steps' means) and `response_length_max` (their max);
- `samples_per_s`, `trained_tokens_per_s`, `staleness_max` (`async/staleness/max`), `dropped_samples` (past the
  bound, kept out of training: `async/dropped`, summed) and `engine_idle_share`: the
  engines' idle share of the step as above, streaming's measured by its scheduler (`async/engine_idle_share`: time
  with nothing to decode). Streaming's `gen_s` is a batch's span, from its first group admitted to its last done.

`ideal_async_step_s` = max(gen, train) of the synchronous run: the step of a perfect one-step-off pipeline, where
the longer of the two hides the other completely; `async_step_s` beside it is the one measured, and `ideal_ratio` the
speed-up the ideal pipeline would have. `engine` (rl_megatron/bench/engine_steps.py, measured after the runs on an
engine built as theirs): a decode step's seconds holding one sequence (`one_step_s`) and a whole step's samples
(`full_step_s`, `width`), their ratio, and `full_samples_per_s`, the samples/s of an engine decoding only full steps
for answers of the streaming run's mean length: the limit of any rollout schedule; `streaming_vs_full_engine` is
streaming's samples/s against it. The figure (`value`) is the one-step-off run's steps/s; `ratio` = synchronous
step / one-step-off step, the speed-up (the `limit`: the synchronous run's steps/s); `streaming_vs_one_step_off`
= one-step-off step / streaming step, streaming's samples/s against one-step-off's.

On 2 CPU cores both sides compete for the same cores: the engine process and the trainer process each have one
core, but the controller (with its generation thread), the reward scorers and Ray's own processes share them, and
generating batch k + 1 slows training on batch k (and the reverse) — so one-step-off's measured step falls short of
the ideal max(gen, train), and both its gen and train come out longer than the synchronous run's. On GPUs the
engines and the trainer own separate devices: generation and training truly run in parallel, and the gap to the
ideal closes to the weight-sync time (the trainer's sync waits for the batch being generated to end, and the
engines wait for the sync).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

from rl_megatron.bench.engine_steps import engine_limit
from rl_megatron.config.choices import ONE_STEP_OFF, STREAMING, SYNC

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/demo_cpu.yaml"  # every run's, relative to REPO
DEFAULT_STEPS = 8
DEFAULT_MAX_TOKENS = 64
# the runs, by their names in the output: trainer.async_mode (each asynchronous one at --staleness, default 1)
MODES = {"synchronous": SYNC, "one_step_off": ONE_STEP_OFF, "streaming": STREAMING}
# --workload: the overrides of the demo's answers (of up to max_tokens). demo: as the random model ends them (roughly
# geometric lengths); long_tail: lengths drawn log-normally, a few ~10x the median, decoded exactly
# (rl_megatron/bench/long_tail.py; an agent loop's response budget is rollout.multi_turn.max_response_length).
WORKLOADS = {"demo": lambda max_tokens: (),
             "long_tail": lambda max_tokens: ("rollout.agent_loop=rl_megatron.bench.long_tail:LongTailLoop",
                                              "rollout.ignore_eos=true",
                                              f"rollout.multi_turn.max_response_length={max_tokens}")}
RUN_TIMEOUT_S = 1200


def engine_overrides(max_tokens: int, workload: str) -> list[str]:
    """What every run sets of the demo's config that its engine sees: one trainer worker and one engine of its own,
    the answers' budget and the workload."""
    return ["trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
            f"rollout.max_tokens={max_tokens}", *WORKLOADS[workload](max_tokens)]


def trainer_command(experiment: str, mode: str, steps: int, max_tokens: int, log_dir: str,
                    workload: str = "demo", staleness: int = 1) -> list[str]:
    return [sys.executable, "-m", "rl_megatron.train", "--config", CONFIG, *engine_overrides(max_tokens, workload),
            f"trainer.async_mode={mode}", f"trainer.rollout_staleness={staleness if mode != SYNC else 0}",
            f"trainer.total_steps={steps}", "trainer.target_reward=null", "trainer.save_every=-1",
            "trainer.progress_bar=false", f"trainer.log_dir={log_dir}", f"trainer.experiment_name={experiment}"]


def train(experiment: str, mode: str, steps: int, max_tokens: int, workload: str = "demo", staleness: int = 1
          ) -> tuple[list[dict], float]:
    """One run of the trainer in a temporary log directory: its metrics.jsonl rows, and its wall time."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix=f"rl_megatron_bench_async_{experiment}_") as log_dir:
        start = time.perf_counter()
        done = subprocess.run(trainer_command(experiment, mode, steps, max_tokens, log_dir, workload, staleness),
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"the {experiment} run (trainer.async_mode={mode}) failed with exit code "
                               f"{done.returncode}:\n{done.stderr[-3000:]}")
        with open(os.path.join(log_dir, experiment, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows, seconds


def figures(rows: list[dict], mode: str, samples_per_step: int) -> dict:
    """The mode's means over its steady steps (every step but the first and the last)."""
    steady = rows[1:-1]
    if not steady:
        raise ValueError(f"{len(rows)} steps: the figures need at least 3 (the first and the last are left out)")

    def mean(values):
        return sum(values) / len(values)

    step = mean([r["timing_s/step"] for r in steady])
    gen = mean([r["timing_s/gen"] for r in steady])
    if mode != SYNC:
        wait_for_rollout = mean([r["timing_s/wait_for_rollout"] for r in steady])
        wait_for_train = mean([r["timing_s/wait_for_train"] for r in steady])
        train_s = step - wait_for_rollout
        generated, waited = sum(r["timing_s/gen"] for r in rows), sum(r["timing_s/wait_for_rollout"] for r in rows)
        overlap = min(1.0, max(0.0, (generated - waited) / generated)) if generated > 0 else 0.0
    else:  # the trainer idles through the generation, the engines through the training
        train_s = step - gen
        wait_for_rollout, wait_for_train, overlap = gen, train_s, 0.0
    return {"steps": len(rows), "measured_steps": [r["step"] for r in steady], "step_s": step, "gen_s": gen,
            "train_s": train_s, "wait_for_rollout_share": wait_for_rollout / step,
            "wait_for_train_share": wait_for_train / step, "overlap": overlap,
            "old_log_prob_s": mean([r["timing_s/old_log_prob"] for r in steady]),
            "update_actor_s": mean([r["timing_s/update_actor"] for r in steady]),
            "sync_weights_s": mean([r["timing_s/sync_weights"] for r in steady]),
            "response_length_mean": mean([r["response_length/mean"] for r in steady]),
            "response_length_max": max(r["response_length/max"] for r in steady),
            "samples_per_s": samples_per_step / step,
            "trained_tokens_per_s": mean([r["response_length/mean"] * samples_per_step / r["timing_s/step"]
                                          for r in steady]),
            "engine_idle_share": (mean([r["async/engine_idle_share"] for r in steady]) if mode == STREAMING
                                  else wait_for_train / step),
            "staleness_max": max(r.get("async/staleness/max", 0) for r in steady),
            "dropped_samples": sum(r.get("async/dropped", 0) for r in steady)}


def samples_per_step() -> int:
    """The demo's prompts a step times the samples of each (configs/demo_cpu.yaml)."""
    with open(os.path.join(REPO, CONFIG)) as f:
        demo = yaml.safe_load(f)
    return demo["data"]["train_batch_size"] * demo["rollout"]["n"]


def median_run(runs: list[dict]) -> dict:
    """Of one mode's runs (their `figures`), the one of median samples/s: the lower middle one of an even count."""
    return sorted(runs, key=lambda run_figures: run_figures["samples_per_s"])[(len(runs) - 1) // 2]


def run(args) -> dict:
    steps, repeats = args.steps or DEFAULT_STEPS, args.repeats or 1
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS
    if args.staleness < 1:
        raise SystemExit("bench async: --staleness must be at least 1 (the bound of the asynchronous runs)")
    if steps < 3:
        raise SystemExit("bench async: --steps must be at least 3 (the first and the last steps are left out)")
    runs, samples = {name: [] for name in MODES}, samples_per_step()
    for _ in range(repeats):  # the modes interleaved: a machine whose speed drifts moves each mode's runs alike
        for name, mode in MODES.items():
            rows, seconds = train(name, mode, steps, max_tokens, args.workload, args.staleness)
            runs[name].append(figures(rows, mode, samples) | {"run_s": seconds})
    modes = {name: median_run(mode_runs) | {"samples_per_s_by_repeat": [r["samples_per_s"] for r in mode_runs]}
             for name, mode_runs in runs.items()}
    sync, one_off, streaming = modes["synchronous"], modes["one_step_off"], modes["streaming"]
    ideal = max(sync["gen_s"], sync["train_s"])
    engine = engine_limit(REPO, CONFIG, engine_overrides(max_tokens, args.workload), samples,
                          streaming["response_length_mean"])
    return {"bench": "async", "value": 1 / one_off["step_s"], "unit": "steps/s",
            "ratio": sync["step_s"] / one_off["step_s"],
            "limit_name": "synchronous steps/s", "limit": 1 / sync["step_s"],
            "sync_step_s": sync["step_s"], "async_step_s": one_off["step_s"],
            "ideal_async_step_s": ideal, "ideal_ratio": sync["step_s"] / ideal,
            "streaming_vs_one_step_off": one_off["step_s"] / streaming["step_s"],
            "streaming_vs_one_step_off_by_repeat": [one_off_run["step_s"] / streaming_run["step_s"] for one_off_run,
                                                    streaming_run in zip(runs["one_step_off"], runs["streaming"])],
            "engine": engine, "streaming_vs_full_engine": streaming["samples_per_s"] / engine["full_samples_per_s"],
            "steps": steps, "repeats": repeats, "max_tokens": max_tokens, "workload": args.workload,
            "staleness": args.staleness,
            "modes": modes}
