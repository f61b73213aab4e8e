"""The training loop: one single controller driving the actor+rollout workers, step by step.

    prompts -> generate (vLLM) -> score (rules) -> old log-probs (Megatron) -> advantages (GRPO)
            -> PPO-clip update (Megatron) -> sync weights (Megatron -> vLLM) -> log

Everything parallel hides behind the worker group; everything numeric is a pure function.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm

from rl_megatron import rewards
from rl_megatron.algorithms import grpo_advantages, masked_mean
from rl_megatron.config import Config, ConfigError, read_hf_config, to_yaml
from rl_megatron.data import TASKS
from rl_megatron.data.loader import PromptLoader
from rl_megatron.tracking import Tracker
from rl_megatron.trainer.sequences import pack_generations
from rl_megatron.workers.actor_rollout import ActorRolloutWorker
from rl_megatron.workers.cluster import start_ray
from rl_megatron.workers.worker_group import ResourcePool, WorkerGroup

REWARD_WINDOW = 5  # steps averaged for early stopping and the final summary


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = time.perf_counter() - start


def build_actor(cfg: Config, hf_config: dict, cpus: int) -> WorkerGroup:
    pool = ResourcePool(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node)
    steps_per_rl_step = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs
    threads = max(1, cpus // pool.world_size)
    return WorkerGroup(ActorRolloutWorker, pool, cfg, hf_config, cfg.trainer.total_steps * steps_per_rl_step,
                       threads, env=worker_env(threads, local_cluster=cfg.ray.address is None))


def worker_env(threads: int, local_cluster: bool) -> dict:
    from rl_megatron.rollout.vllm_engine import CPU_ENGINE_ENV, ENGINE_ENV

    env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(threads)}
    if not torch.cuda.is_available():
        env.update(CPU_ENGINE_ENV)
        if local_cluster:  # everything on this machine: keep gloo on the loopback interface
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env


def score(generations: list, prompts: dict, tokenizer, n: int) -> torch.Tensor:
    """Rule-based reward of each sample; sample i answers prompt i // n."""
    return torch.tensor([
        rewards.score(prompts["data_source"][i // n], tokenizer.decode(g.response_ids, skip_special_tokens=True),
                      prompts["ground_truth"][i // n])
        for i, g in enumerate(generations)])


def step_metrics(scores: torch.Tensor, batch: dict, entropy: torch.Tensor, pad_id: int,
                 seconds: dict[str, float]) -> dict[str, float]:
    mask = batch["response_mask"]
    return {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item(),
        "response_length/mean": mask.sum(1).mean().item(),
        "actor/entropy": masked_mean(entropy, mask).item(),
        # vLLM's sampling log-probs against Megatron's for the same tokens: ~1e-7 when both agree.
        "rollout/logprob_diff_mean": masked_mean((batch["old_log_probs"] - batch["rollout_log_probs"]).abs(),
                                                 mask).item(),
        **{f"timing_s/{phase}": s for phase, s in seconds.items()},
        "perf/tokens_per_s": (batch["input_ids"] != pad_id).sum().item() / seconds["step"],
    }


def train(cfg: Config) -> dict:
    """Run `cfg.trainer.total_steps` RL steps (or until the target reward); returns a summary."""
    from transformers import AutoTokenizer

    hf_config = read_hf_config(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        loader = PromptLoader(TASKS[cfg.data.task](), tokenizer, cfg.data.train_batch_size,
                              cfg.data.max_prompt_length, cfg.trainer.seed)
    except ValueError as err:
        raise ConfigError(f"data.task={cfg.data.task}: {err}") from None
    run_dir = os.path.join(cfg.trainer.log_dir, cfg.trainer.experiment_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))

    reward_history: list[float] = []
    timer = Timer()
    with build_actor(cfg, hf_config, start_ray(cfg)) as actor, Tracker(run_dir) as tracker:
        actor.sync_weights()  # the engines start from dummy weights: give them the policy's
        bar = tqdm(range(1, cfg.trainer.total_steps + 1), desc="GRPO", unit="step",
                   disable=not cfg.trainer.progress_bar)
        for step in bar:
            with timer("step"):
                prompts = loader.next_batch()
                with timer("gen"):
                    generations = actor.generate(prompts["prompt_ids"])
                scores = score(generations, prompts, tokenizer, cfg.rollout.n)
                batch = pack_generations(generations, pad_id)
                with timer("old_log_prob"):
                    old = actor.log_probs({"input_ids": batch["input_ids"]})
                batch["old_log_probs"] = old["log_probs"]
                group_ids = torch.arange(len(generations)) // cfg.rollout.n  # samples of a prompt are adjacent
                batch["advantages"] = grpo_advantages(scores, group_ids, cfg.algorithm.norm_adv_by_std)
                with timer("update_actor"):
                    update_metrics = actor.update(batch)[0]
                with timer("sync_weights"):
                    actor.sync_weights()
            metrics = {**step_metrics(scores, batch, old["entropy"], pad_id, timer.seconds), **update_metrics}
            tracker.log(metrics, step)
            reward_history.append(metrics["reward/mean"])
            recent = sum(reward_history[-REWARD_WINDOW:]) / len(reward_history[-REWARD_WINDOW:])
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", avg5=f"{recent:.3f}",
                            step_s=f"{timer.seconds['step']:.2f}")
            if cfg.trainer.target_reward is not None and len(reward_history) >= REWARD_WINDOW \
                    and recent >= cfg.trainer.target_reward:
                break
    first = reward_history[:REWARD_WINDOW]
    return {"steps": len(reward_history), "reward_first": sum(first) / len(first), "reward_last": recent,
            "reward_window": len(first), "run_dir": run_dir}
