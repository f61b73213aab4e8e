"""The training loop: one single controller driving the workers, step by step.

    prompts -> generate (vLLM) -> score (rules) -> old log-probs (Megatron) [-> reference log-probs, values]
            -> advantages (GRPO, GAE, ...) [-> critic update] -> PPO update (Megatron)
            -> sync weights (Megatron -> vLLM) -> log

Everything parallel hides behind the worker groups; everything numeric is a pure function.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager

import ray
import torch
from tqdm import tqdm

from rl_megatron import platform
from rl_megatron.algorithms import (apply_kl_penalty, compute_advantages, kl_controller, masked_mean,
                                    outcome_token_rewards, rollout_mismatch_metrics, truncated_importance_weights)
from rl_megatron.checkpoint import CheckpointError, check_checkpoint
from rl_megatron.checkpoint.run import checkpointed_roles, choose_resume, finish_save, start_save
from rl_megatron.config import Config, ConfigError, model_config, to_yaml, worker_pools
from rl_megatron.data.build import build_prompt_loader
from rl_megatron.launch import format_plan
from rl_megatron.rewards import REGISTRY
from rl_megatron.rewards.scorer import RewardScorer
from rl_megatron.rollout.vllm_engine import request_seeds
from rl_megatron.tracking import Tracker
from rl_megatron.trainer.sequences import pack_generations
from rl_megatron.trainer.stopping import StopSignals
from rl_megatron.trainer.validation import generations_table, validation_metrics
from rl_megatron.workers.cluster import start_ray
from rl_megatron.workers.hybrid_worker import HybridWorker
from rl_megatron.workers.rollout_worker import RolloutWorker
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


def build_workers(cfg: Config, hf_config: dict, cpus: int, stack: ExitStack) -> dict[str, WorkerGroup]:
    """The worker groups, by role ("actor", "rollout", "ref", "critic"; a colocated role maps to the actor's
    group); closed by `stack`."""
    pools = worker_pools(cfg)
    threads = max(1, cpus // sum(pool.nnodes * pool.gpus_per_node for pool in pools))
    env = worker_env(threads, local_cluster=cfg.ray.address is None)
    groups = {}
    for pool in pools:
        devices = ResourcePool(pool.nnodes, pool.gpus_per_node, config_keys=(pool.nodes_key, pool.gpus_key))
        if pool.name == "rollout":
            group = WorkerGroup(RolloutWorker, devices, cfg, hf_config, threads, env=env)
        else:
            group = WorkerGroup(HybridWorker, devices, cfg, hf_config, pool.roles, pool.layout, threads, env=env)
        groups.update(dict.fromkeys(pool.roles, stack.enter_context(group)))
    if groups["rollout"] is not groups["actor"]:
        connect_engines(groups["actor"], groups["rollout"])
    return groups


def connect_engines(actor: WorkerGroup, rollout: WorkerGroup) -> None:
    """Separate engines: the actor's rank 0 and every engine worker form the group the weights are broadcast in."""
    host, port = actor.rank0_address()
    size = 1 + rollout.pool.world_size
    joining = rollout.call_async("join_weight_group", host, port, size)
    actor.join_weight_group(host, port, size)
    ray.get(joining)


def sync_weights(actor: WorkerGroup, rollout: WorkerGroup) -> None:
    """The policy's current weights into the engines: colocated, each actor worker writes its engines' share;
    separate, the actor's rank 0 broadcasts them and the engine workers receive (both at once)."""
    receiving = [] if rollout is actor else rollout.call_async("sync_weights")
    actor.sync_weights()
    ray.get(receiving)


def worker_env(threads: int, local_cluster: bool) -> dict:
    from rl_megatron.rollout.vllm_engine import CPU_ENGINE_ENV, ENGINE_ENV

    env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(threads)}
    if not torch.cuda.is_available():
        env.update(CPU_ENGINE_ENV)
        if local_cluster:  # everything on this machine: keep gloo on the loopback interface
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env


def submit_scoring(scorer: RewardScorer, generations: list, prompts: dict, tokenizer, n: int) -> Future:
    """Start scoring the samples (sample i answers prompt i // n) in the scorer's processes; the controller goes on
    meanwhile. The future gives (scores, {"reward/timeouts", "reward/errors"})."""
    owner = [i // n for i in range(len(generations))]
    # Prompts keep their special tokens: scorers look for the chat template's markers (<|im_start|>assistant).
    prompt_texts = [tokenizer.decode(ids) for ids in prompts["prompt_ids"]]
    return scorer.submit([prompts["data_source"][p] for p in owner],
                         [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations],
                         [prompts["ground_truth"][p] for p in owner], [prompts["extra_info"][p] for p in owner],
                         prompts=[prompt_texts[p] for p in owner])


def validate(rollout: WorkerGroup, val_loader, scorer: RewardScorer, tokenizer, cfg: Config,
             step: int) -> tuple[dict, str]:
    """One pass over the validation prompts: rollout.val_n answers each (greedy for one); rewards per data source,
    pass@k, and a table of the first samples."""
    n, engines = cfg.rollout.val_n, rollout.meshes[0]["rollout"][1]
    sources, scores, texts = [], [], []
    for batch_index, prompts in enumerate(val_loader.in_order()):
        ids = prompts["prompt_ids"]
        padded = ids + ids[:1] * (-len(ids) % engines)  # every engine gets as many prompts
        seeds = request_seeds(cfg.trainer.seed, f"validation {batch_index}", step, len(padded))
        generations = rollout.generate_for_validation(padded, seeds)[:len(ids) * n]
        batch_scores, _ = submit_scoring(scorer, generations, prompts, tokenizer, n).result()
        sources += prompts["data_source"]
        scores.append(batch_scores)
        texts += [(tokenizer.decode(g.prompt_ids, skip_special_tokens=True),
                   tokenizer.decode(g.response_ids, skip_special_tokens=True)) for g in generations]
    scores = torch.cat(scores)
    rows = cfg.trainer.val_generations_to_log
    table = generations_table([p for p, _ in texts], [r for _, r in texts], scores.tolist(), rows)
    return validation_metrics(sources, scores, n), table


def step_metrics(scores: torch.Tensor, batch: dict, entropy: torch.Tensor, pad_id: int,
                 seconds: dict[str, float]) -> dict[str, float]:
    mask = batch["response_mask"]
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item(),
        "response_length/mean": mask.sum(1).mean().item(),
        "actor/entropy": masked_mean(entropy, mask).item(),
        "critic/advantages/mean": masked_mean(batch["advantages"], mask).item(),
        # vLLM's sampling log-probs against Megatron's for the same tokens (1 and 0 when both agree).
        **rollout_mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask),
        **{f"timing_s/{phase}": s for phase, s in seconds.items()},
        "perf/tokens_per_s": (batch["input_ids"] != pad_id).sum().item() / seconds["step"],
    }
    if "values" in batch:
        values, returns = batch["values"], batch["returns"]
        residual_var = torch.var((returns - values)[mask.bool()])
        metrics.update({"critic/values/mean": masked_mean(values, mask).item(),
                        "critic/returns/mean": masked_mean(returns, mask).item(),
                        # 1 - Var(returns - values) / Var(returns): how much of the returns the critic predicts.
                        "critic/vf_explained_var": (1 - residual_var / torch.var(returns[mask.bool()])).item()})
    return metrics


def select(batch: dict, *keys: str) -> dict:
    return {key: batch[key] for key in keys if key in batch}


def train(cfg: Config) -> dict:
    """Run `cfg.trainer.total_steps` RL steps (or until the target reward), resuming from a checkpoint per
    trainer.resume and saving per trainer.save_every; returns a summary."""
    from transformers import AutoTokenizer

    hf_config = model_config(cfg)  # config.json with the moe section's overrides
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loader = build_prompt_loader(cfg.data, tokenizer, cfg.trainer.seed)
    validating = cfg.trainer.val_every > 0 or cfg.trainer.val_before_train
    val_loader = build_prompt_loader(cfg.data, tokenizer, cfg.trainer.seed, split="val") if validating else None
    if cfg.reward.custom_fn is None:  # every row needs a scorer: find out now, not at its first batch
        unknown = {row["data_source"] for data in (loader, val_loader) if data for row in data.rows} - set(REGISTRY)
        if unknown:
            raise ConfigError(f"The data's data_source {', '.join(map(repr, sorted(unknown)))} has no reward function "
                              f"(known: {', '.join(sorted(REGISTRY))}). Set reward.custom_fn=pkg.module:fn, or "
                              "register one with @rl_megatron.rewards.register.")
    run_dir = os.path.join(cfg.trainer.log_dir, cfg.trainer.experiment_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))

    alg = cfg.algorithm
    kl_ctrl = kl_controller(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon)
    reward_history: list[float] = []
    # Every checkpoint check runs before a worker starts: a bad one costs seconds, not a cluster's start-up.
    if cfg.model.checkpoint is not None:
        check_checkpoint(cfg.model.checkpoint, hf_config)
    checkpoint_root = cfg.trainer.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    resume = choose_resume(checkpoint_root, cfg.trainer.resume, hf_config, checkpointed_roles(cfg),
                           cfg.actor.expert_model_parallel_size)
    start_step = 0
    if resume is not None:
        resume_dir, state = resume
        try:
            loader.load_state_dict(state["data_loader"])
        except ValueError as err:
            raise CheckpointError(f"Checkpoint '{resume_dir}' cannot resume this run's data: {err}.") from None
        kl_ctrl.value, reward_history, start_step = state["kl_coef"], state["reward_history"], state["step"]

    print(format_plan(cfg, on_gpu=platform.has_cuda()), flush=True)
    timer = Timer()
    with ExitStack() as stack:
        workers = build_workers(cfg, hf_config, start_ray(cfg), stack)
        actor, rollout, ref, critic = workers["actor"], workers["rollout"], workers.get("ref"), workers.get("critic")
        # The groups hosting Megatron models (what a checkpoint saves).
        groups = list({id(group): group for group in (actor, ref, critic) if group is not None}.values())
        stop = stack.enter_context(StopSignals())  # after Ray's start: Ray installs a SIGTERM handler of its own
        # A resumed run rewrites the steps after its checkpoint: their old records go.
        tracker = stack.enter_context(Tracker(run_dir, purge_after=start_step if resume else None))
        scorer = stack.enter_context(RewardScorer(cfg.reward))
        if resume is not None:
            rng_restored = all(done for group in groups for done in group.load_checkpoint(resume_dir))
            tqdm.write(f"Resumed from {resume_dir} (step {start_step})" + (
                "" if rng_restored else "; the workers' RNG states were saved under another parallel layout and "
                "start afresh (sampling seeds depend only on trainer.seed and the step, so rollouts are unaffected)"))
        sync_weights(actor, rollout)  # the engines start from dummy weights: give them the policy's

        def maybe_validate(step: int, last: bool = False) -> None:
            every = cfg.trainer.val_every
            if val_loader is None or not ((step == 0 and cfg.trainer.val_before_train)
                                          or (every and step > 0 and (step % every == 0 or last))):
                return
            with timer("validate"):
                val_metrics, table = validate(rollout, val_loader, scorer, tokenizer, cfg, step)
            tracker.log(val_metrics, step)
            tracker.log_text("val/generations", table, step)
            tqdm.write(f"step {step} validation: " + ", ".join(f"{k}={v:.3f}" for k, v in val_metrics.items()))

        def save_checkpoint(step: int) -> None:
            start = time.perf_counter()
            partial = start_save(checkpoint_root, step)
            for group in groups:
                group.save_checkpoint(partial)
            state = {"data_loader": loader.state_dict(), "kl_coef": kl_ctrl.value, "reward_history": reward_history}
            folder = finish_save(checkpoint_root, step, state, to_yaml(cfg), cfg.trainer.keep_last)
            tqdm.write(f"step {step}: checkpoint saved to {folder} in {time.perf_counter() - start:.1f} s")

        if start_step == 0:
            maybe_validate(0)
        done = start_step >= cfg.trainer.total_steps or reached_target(reward_history, cfg.trainer.target_reward)
        bar = tqdm(range(start_step + 1, cfg.trainer.total_steps + 1), desc=alg.adv_estimator.upper(), unit="step",
                   initial=start_step, total=cfg.trainer.total_steps, disable=not cfg.trainer.progress_bar or done)
        for step in ([] if done else bar):
            timer.seconds.clear()
            with timer("step"):
                prompts = loader.next_batch()
                with timer("gen"):
                    generations = rollout.generate(prompts["prompt_ids"], request_seeds(
                        cfg.trainer.seed, "train", step, len(prompts["prompt_ids"])))
                scoring = submit_scoring(scorer, generations, prompts, tokenizer, cfg.rollout.n)
                batch = pack_generations(generations, pad_id)
                sequences, mask = select(batch, "input_ids"), batch["response_mask"]
                with timer("old_log_prob"):
                    old = actor.log_probs(sequences)
                batch["old_log_probs"] = old["log_probs"]
                if ref is not None:
                    with timer("ref"):
                        batch.update(ref.ref_log_probs(sequences))
                if critic is not None:
                    with timer("values"):
                        batch.update(critic.values(sequences))
                with timer("reward"):  # what scoring adds to the step after the forward passes
                    scores, metrics = scoring.result()
                token_rewards = outcome_token_rewards(scores, mask)
                if alg.use_kl_in_reward:
                    token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                         mask, kl_ctrl.value, alg.kl_penalty)
                    metrics.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": kl_ctrl.value})
                    kl_ctrl.update(kl, n_steps=len(generations))
                group_ids = torch.arange(len(generations)) // cfg.rollout.n  # samples of a prompt are adjacent
                batch["advantages"], returns = compute_advantages(
                    alg.adv_estimator, token_rewards, mask, group_ids, values=batch.get("values"), gamma=alg.gamma,
                    lam=alg.lam, norm_by_std=alg.norm_adv_by_std)
                if alg.rollout_is_cap is not None:
                    batch["importance_weights"] = truncated_importance_weights(
                        batch["old_log_probs"], batch["rollout_log_probs"], alg.rollout_is_cap)
                if critic is not None:
                    batch["returns"] = returns
                    with timer("update_critic"):
                        metrics.update(critic.update_critic(
                            select(batch, "input_ids", "response_mask", "values", "returns"))[0])
                if step > cfg.critic.warmup_steps:  # the actor waits for the critic's warm-up
                    with timer("update_actor"):
                        metrics.update(actor.update(select(batch, "input_ids", "response_mask", "old_log_probs",
                                                           "advantages", "ref_log_probs", "importance_weights"))[0])
                    with timer("sync_weights"):
                        sync_weights(actor, rollout)
            reward_history.append(scores.mean().item())
            done = step == cfg.trainer.total_steps or reached_target(reward_history, cfg.trainer.target_reward)
            maybe_validate(step, last=done)
            metrics.update(step_metrics(scores, batch, old["entropy"], pad_id, timer.seconds))
            tracker.log(metrics, step)  # before the checkpoint: a run resumed from it has logged this step
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", avg5=f"{window_mean(reward_history):.3f}",
                            step_s=f"{timer.seconds['step']:.2f}")
            every = cfg.trainer.save_every
            if (every > 0 and step % every == 0) or (every >= 0 and (done or stop.received)):
                save_checkpoint(step)
            if done or stop.received:
                break
    if start_step and start_step == len(reward_history):
        tqdm.write(f"Nothing to do: the checkpoint at step {start_step} already finished this run "
                   "(trainer.total_steps or trainer.target_reward); raise trainer.total_steps to go on.")
    elif stop.received and not done:
        tqdm.write(f"Stopped by {stop.received} after step {len(reward_history)}; the same command resumes from "
                   "its checkpoint.")
    first = reward_history[:REWARD_WINDOW]
    return {"steps": len(reward_history), "reward_first": sum(first) / len(first),
            "reward_last": window_mean(reward_history), "reward_window": len(first), "run_dir": run_dir}


def window_mean(rewards: list[float]) -> float:
    """The mean reward of the last REWARD_WINDOW steps."""
    recent = rewards[-REWARD_WINDOW:]
    return sum(recent) / len(recent)


def reached_target(rewards: list[float], target: float | None) -> bool:
    return target is not None and len(rewards) >= REWARD_WINDOW and window_mean(rewards) >= target
