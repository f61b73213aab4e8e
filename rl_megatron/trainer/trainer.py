"""The training loop: one single controller driving the workers, step by step.

    prompts -> generate (rollout.function over the engines, rollout.engine's) -> score (reward scorers, in the
            background) -> old log-probs [-> reference, teacher log-probs, values, reward model scores] (Megatron:
            `forward_passes.py`)
            -> advantages (GRPO, GAE, ... [+ distillation]) -> [critic update] -> PPO update (Megatron) -> sync
            weights (Megatron -> the engines) -> log

With trainer.rollout_staleness > 0 the first stage runs ahead in a generation thread (`rollout_ahead.py`): the
engines generate the next batches while the trainer trains on this one; or, trainer.async_mode=streaming, prompt groups
stream through the engines and the step takes the oldest ready (`streaming.py`).

Everything parallel hides behind the worker groups; everything numeric is a pure function (`rl_megatron.algorithms`);
the data between the stages is typed (`rl_megatron.batch`).
"""
from __future__ import annotations

import os
import time
from contextlib import ExitStack

import torch

from rl_megatron import platform
from rl_megatron.platform.startup import startup_done
from rl_megatron.agents import AgentRunner, build_agent_loop
from rl_megatron.algorithms import (AdvantageInputs, apply_kl_penalty, compute_advantages, distillation_advantages,
                                    kl_controller, outcome_token_rewards, rollout_correction_weights)
from rl_megatron.batch import Prompt, Sample, TrainBatch, pad_token_id
from rl_megatron.checkpoint import CheckpointError, check_checkpoint
from rl_megatron.checkpoint.run import (checkpoint_root, checkpointed_roles, choose_resume, finish_save,
                                        load_rollouts_ahead, save_rollouts_ahead, start_save)
from rl_megatron.config import Config, to_dict, to_yaml
from rl_megatron.config.choices import STREAMING
from rl_megatron.config.pools import uses_reward_model, worker_pools
from rl_megatron.data.build import build_prompt_loader
from rl_megatron.models.hf_config import end_of_sequence_ids, model_config
from rl_megatron.models.tokenizer import checked_tokenizer
from rl_megatron.planning import format_plan
from rl_megatron.plugins import import_user_modules, load_callable
from rl_megatron.rewards.scorer import RewardScorer, Scored
from rl_megatron.roles import Role
from rl_megatron.rollout.engines import RolloutEngines, RolloutFn, Sampling, round_purpose
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.sequences import balanced_order
from rl_megatron.tracking import Tracker
from rl_megatron.trainer.metrics import RunSummary, Timer, reached_target, step_metrics, window_mean
from rl_megatron.trainer.dynamic_sampling import GroupFilter
from rl_megatron.trainer.forward_passes import forward_passes
from rl_megatron.trainer.old_log_probs import old_log_probs_from_update, update_actor
from rl_megatron.trainer.perf import actor_mfu_metrics, memory_metrics
from rl_megatron.trainer.profiling import StepProfiles
from rl_megatron.trainer.rollout_ahead import (Ahead, InStep, Rollout, checked_samples, current_version_mismatch,
                                               drop_stale)
from rl_megatron.trainer.rollout_records import RolloutRecords
from rl_megatron.trainer.judge import Judge
from rl_megatron.trainer.reward_model import RewardModelScorer
from rl_megatron.trainer.rewards import Rewards, check_scorers
from rl_megatron.trainer.stopping import StopSignals
from rl_megatron.trainer.streaming import StreamSettings, Streaming
from rl_megatron.trainer.validation import GENERATION_COLUMNS, Validation, validate, validation_file, weights_source
from rl_megatron.trainer.workers import build_workers, sync_weights
from rl_megatron.workers.cluster import start_ray
from rl_megatron.workers.run_logs import controller_log, logs_dir


def train(cfg: Config) -> RunSummary:
    """Run `cfg.trainer.total_steps` RL steps (or until the target reward); returns a summary."""
    return Trainer(cfg).fit()


class Trainer:
    """Everything a run reads before a worker starts (config, model config, data, user code, the checkpoint to
    resume from) is read and checked in the constructor, so bad input costs seconds, not a cluster's start-up."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        import_user_modules(cfg.trainer.imports)  # before anything looks up what they register
        self.rollout_fn: RolloutFn = load_callable(cfg.rollout.function, "rollout.function")
        self.hf_config = model_config(cfg)  # config.json with the moe section's overrides
        self.tokenizer = checked_tokenizer(cfg.model.path, self.hf_config)  # the one the pre-flight check loaded
        self.pad_id = pad_token_id(self.tokenizer)
        self.reward_model = RewardModelScorer(cfg, self.tokenizer) if uses_reward_model(cfg) else None
        self.judge = Judge(cfg, self.tokenizer) if cfg.judge.enable else None
        self.agent_loop = build_agent_loop(cfg.rollout, self.tokenizer,
                                           end_of_sequence_ids(cfg.model.path, self.hf_config), cfg.model.path)
        tools = self.agent_loop.context.tools.schemas() if self.agent_loop and self.agent_loop.context.tools else None
        self.loader = build_prompt_loader(cfg.data, self.tokenizer, cfg.trainer.seed, tools=tools)
        validating = cfg.trainer.val_every > 0 or cfg.trainer.val_before_train or cfg.trainer.val_only
        self.val_loader = (build_prompt_loader(cfg.data, self.tokenizer, cfg.trainer.seed, split="val", tools=tools)
                           if validating else None)
        if not (cfg.rollout.agent.function and cfg.rollout.agent.reward == "function"):  # else the agent's reward
            check_scorers(cfg.reward, [loader for loader in (self.loader, self.val_loader) if loader is not None])
        self.run_dir = cfg.trainer.run_dir
        os.makedirs(self.run_dir, exist_ok=True)
        if not cfg.trainer.val_only:  # a validation of a run's checkpoint leaves the run's own config
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.reward_history: list[float] = []
        self.last_validation: Validation | None = None
        self.group_filter = GroupFilter.of(cfg)  # dynamic sampling, when on
        self.old_from_update = old_log_probs_from_update(cfg, self.hf_config)
        self.timer = Timer()
        if cfg.model.checkpoint is not None:
            check_checkpoint(cfg.model.checkpoint, self.hf_config)
        self.checkpoint_root = checkpoint_root(cfg)
        self.resume = choose_resume(self.checkpoint_root, cfg.trainer.resume, self.hf_config, checkpointed_roles(cfg),
                                    cfg.actor.expert_model_parallel_size)
        self.start_step = self._restore_controller_state() if self.resume else 0

    # -- the run ---------------------------------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        cfg, total = self.cfg.trainer, self.cfg.trainer.total_steps
        print(format_plan(self.cfg, on_gpu=platform.has_cuda()), flush=True)
        with ExitStack() as stack:
            self._start_workers(stack)
            startup_done()
            self.training_started = time.time()
            if cfg.val_only:
                self.tracker.write("Validation only (trainer.val_only): the weights of "
                                   + weights_source(self.cfg.model, self.resume and self.resume[0], self.start_step))
                self.run_validation(self.start_step)
                return self._summary(done=True)
            if self.start_step == 0:
                self.maybe_validate(0)
            done = self.start_step >= total or reached_target(self.reward_history, cfg.target_reward)
            if not done:
                self.tracker.start_progress(self.start_step)
            for step in ([] if done else range(self.start_step + 1, total + 1)):
                metrics = self.train_step(step)
                done = step == total or reached_target(self.reward_history, cfg.target_reward)
                metrics |= self.maybe_validate(step, last=done)
                self.tracker.log(metrics, step)  # before the checkpoint: a run resumed from it has logged this step
                self.tracker.show_step(step, metrics, window_mean(self.reward_history))
                if (cfg.save_every > 0 and step % cfg.save_every == 0) or (
                        cfg.save_every >= 0 and (done or self.stop.received)):
                    self.save_checkpoint(step)
                if done or self.stop.received:
                    break
        return self._summary(done)

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step: generate -> score -> forward passes -> advantages -> update -> sync."""
        timer = self.timer
        timer.seconds.clear()
        for group in self.model_groups:
            group.reset_peak_memory()
        with timer("step"):
            rollout = self.rollouts.take(step, timer)
            metrics = self.staleness(rollout) | rollout.metrics
            order = self.balanced_order(rollout.samples)
            samples = [rollout.samples[i] for i in order]
            group_ids = torch.tensor(order) // self.cfg.rollout.n  # the rollout keeps a prompt's n samples together
            # Scored while Megatron computes (with dynamic sampling, while generating: the filter reads the scores).
            scoring = None if rollout.rewards is not None else self.scorer.submit_samples(samples, self.tokenizer)
            batch = TrainBatch.from_samples(samples, self.pad_id)
            # In the critic's warm-up no actor update gives the old log-probs.
            old_pass = not self.old_from_update or step <= self.cfg.critic.warmup_steps
            with self.profiles.phase(step, "log_prob"):
                rated = forward_passes(self.groups, self.cfg, batch, timer, old_pass, samples, self.reward_model)
            with timer("reward"):  # what scoring adds to the step after the forward passes
                rewards = (rollout.rewards.select(order) if rollout.rewards is not None
                           else self.rewards(scoring.result(), samples))
                judged = None if rollout.judged is None else rollout.judged.select(order)
                rewards = rewards.with_sources([source for source in (rated, judged) if source is not None])
            metrics |= rewards.metrics()
            for sample, score in zip(samples, rewards.scores.tolist()):
                sample.reward = score
            metrics |= self.advantages(batch, rewards.scores, group_ids)
            self.records.write(step, samples, order, rewards, batch)  # trainer.rollout_data_dir
            metrics |= self.update(batch, step)
            if self.cfg.trainer.rollout_staleness:
                metrics |= current_version_mismatch(samples, batch, self.version_training(step))
        # With dynamic sampling the batch holds only the groups that vary: the policy's reward is all samples'.
        self.reward_history.append(metrics.get("filter/generated_reward/mean", rewards.scores.mean().item()))
        return (metrics | step_metrics(samples, rewards.scores, batch, timer.seconds, self.cfg.algorithm)
                | self.perf_metrics(samples))

    # -- the stages of a step --------------------------------------------------------------------------------------

    def generate(self, step: int) -> Rollout:
        """The samples of step `step`: its prompts through the rollout (now, or ahead in the generation thread); with
        dynamic sampling, rounds of prompts until enough groups vary (`dynamic_sampling.py`)."""
        def generate_round(round_: int) -> list[Sample]:
            return self.rollout(self.loader.next_batch(), Sampling(self.cfg.rollout.n, self.cfg.rollout.temperature,
                                                                   round_purpose("train", round_), step,
                                                                   self.version_training(step)))

        if self.group_filter is None:
            samples = generate_round(1)  # then the judge's verdicts, in the same thread (`judge.py`)
            return Rollout(step, samples, judged=self.judge and self.judge.scores(samples, step))
        filled = self.group_filter.fill(generate_round, lambda new, round_: self.score_now(new, step, round_))
        if self.group_filter.cap_note(step, filled):
            self.tracker.write(self.group_filter.cap_note(step, filled))
        return Rollout(step, filled.samples, filled.rewards, filled.metrics)

    def version_training(self, step: int) -> int:
        """The policy version that trains step `step`'s batch (an actor update a step, after the critic's warm-up)."""
        return max(0, step - 1 - self.cfg.critic.warmup_steps)

    def rewards(self, scored: Scored, samples: list[Sample]) -> Rewards:
        """The samples' rewards from their scores (shaped by the overlong penalty when on)."""
        return Rewards.of(scored, samples, self.cfg.reward, self.cfg.rollout.max_tokens)

    def score_now(self, samples: list[Sample], step: int, round_: int) -> Rewards:
        """A dynamic-sampling round's or a streamed group's rewards as generated: the rule's, an RM's, a judge's."""
        rated = [self.reward_model.scores(self.groups[Role.REWARD_MODEL], samples)] if self.reward_model else []
        rated += [self.judge.scores(samples, step, round_)] if self.judge else []
        return self.rewards(self.scorer.submit_samples(samples, self.tokenizer).result(), samples).with_sources(rated)

    def staleness(self, rollout: Rollout) -> dict[str, float]:
        """Asynchronous RL: how many policy versions behind the trainer the batch is (samples past the bound are kept
        out of the loss), how long it took to generate, and how long the engines waited for the trainer before."""
        staleness = self.cfg.trainer.rollout_staleness
        if not staleness:
            return {}
        self.timer.seconds |= {"gen": rollout.seconds, "wait_for_train": rollout.engines_waited_s}
        return drop_stale(rollout.samples, self.policy_version, staleness)

    def rollout(self, prompts: list[Prompt], sampling: Sampling) -> list[Sample]:
        """The run's rollout function (rollout.function) over the engines, its result checked."""
        return checked_samples(self.rollout_fn(self.engines, prompts, sampling), len(prompts), sampling.n,
                               self.cfg.rollout.function)

    def balanced_order(self, samples: list[Sample]) -> list[int]:
        """The order of the samples that gives each of the actor's data-parallel ranks the same number of tokens in
        every mini-batch (trainer.balance_batch; the slowest rank sets the step time)."""
        if not self.cfg.trainer.balance_batch:
            return list(range(len(samples)))
        dp = worker_pools(self.cfg)[0].data_parallel_size
        mini_batch = self.cfg.actor.ppo_mini_batch_size * self.cfg.rollout.n // dp
        return balanced_order([len(s.prompt_ids) + len(s.response_ids) for s in samples], dp, mini_batch)

    def advantages(self, batch: TrainBatch, scores: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
        """Token rewards (with the in-reward KL penalty when on), advantages (with the distillation term when a
        teacher scored the batch) and returns, rollout-correction weights (the update's own where it gives the old
        log-probs); written into `batch`."""
        alg, mask, metrics = self.cfg.algorithm, batch.response_mask, {}
        token_rewards = outcome_token_rewards(scores, mask)
        if alg.use_kl_in_reward:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch.old_log_probs, batch.ref_log_probs, mask,
                                                 self.kl_ctrl.value, alg.kl_penalty)
            metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
            self.kl_ctrl.update(kl, n_steps=batch.rows())
        distilling, returns = batch.teacher_log_probs is not None, None
        if not (distilling and alg.distillation.mode == "alone"):  # the task's advantages
            batch.advantages, returns = compute_advantages(alg.adv_estimator, AdvantageInputs(
                token_rewards, mask, group_ids, values=batch.values, gamma=alg.gamma, lam=alg.lam,
                norm_by_std=alg.norm_adv_by_std), self.cfg.extension_keys)
        if distilling:  # the teacher's term per token (`algorithms/distillation.py`), or with top_k the actor's loss's
            batch.advantages = distillation_advantages(batch.advantages, batch.teacher_log_probs, batch.old_log_probs,
                                                       mask, 0.0 if alg.distillation.top_k else alg.distillation.coef)
        correction = alg.rollout_correction
        if correction.level is not None and batch.old_log_probs is not None:
            batch.importance_weights = rollout_correction_weights(batch.old_log_probs, batch.rollout_log_probs, mask,
                                                                  correction.level, correction.mode,
                                                                  correction.threshold)
        if self.critic is not None:
            batch.returns = returns
        return metrics

    def update(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """The critic's update, then (after its warm-up) the actor's, and the new weights into the engines."""
        metrics, updating_actor = {}, step > self.cfg.critic.warmup_steps  # the actor waits for the critic's warm-up
        with self.profiles.phase(step, "update"):
            if self.critic is not None:
                with self.timer("update_critic"):
                    metrics |= self.critic.update_critic(batch.select("values", "returns"))[0]
            if updating_actor:
                with self.timer("update_actor"):
                    metrics |= update_actor(self.actor, batch, self.cfg.algorithm.rollout_correction)
        if updating_actor:
            self.policy_version += 1
            with (self.rollouts.syncing(self.timer, self.policy_version), self.timer("sync_weights"),
                  self.profiles.phase(step, "sync")):
                sync_weights(self.actor, self.engine_group)
                self.engines.weight_version = self.policy_version
        return metrics

    def perf_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The actor's MFU in the step's timings and the memory its Megatron workers used (`trainer/perf.py`)."""
        stats = {group: group.device_stats() for group in self.model_groups}
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        actor_peaks = [s.peak_flops for s in stats[self.actor]]
        return (actor_mfu_metrics(self.hf_config, lengths, self.timer.seconds, actor_peaks, self.cfg.actor.ppo_epochs)
                | memory_metrics([s for group_stats in stats.values() for s in group_stats]))

    # -- around the steps ------------------------------------------------------------------------------------------

    def maybe_validate(self, step: int, last: bool = False) -> dict[str, float]:
        """Validate when due (before the first step, every trainer.val_every steps, after the last): its time."""
        every = self.cfg.trainer.val_every
        due = (step == 0 and self.cfg.trainer.val_before_train) or (every and step > 0 and (step % every == 0 or last))
        if self.val_loader is None or not due:
            return {}
        self.run_validation(step)
        return {"timing_s/validate": self.timer.seconds["validate"]}

    def run_validation(self, step: int) -> None:
        """Validate the current policy: its val/* metrics and a table of samples logged at `step`, every sample
        with its score written to <run_dir>/validation/step_<step>.jsonl."""
        with self.timer("validate"):
            result = self.rollouts.on_engines(
                lambda: validate(self.rollout, self.val_loader, self.scorer, self.tokenizer, self.cfg, step))
        self.tracker.log(result.metrics, step)
        self.tracker.log_table("val/generations", GENERATION_COLUMNS,
                               result.table_rows(self.cfg.trainer.val_generations_to_log), step)
        result.write_jsonl(validation_file(self.run_dir, step))
        self.last_validation = result
        self.tracker.write(f"step {step} validation: " + ", ".join(f"{k}={v:.3f}" for k, v in result.metrics.items()))

    def save_checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        self.records.wait()  # a run resumed from the checkpoint has written this step's samples
        partial = start_save(self.checkpoint_root, step)
        for group in self.model_groups:
            group.save_checkpoint(partial)
        save_rollouts_ahead(partial, self.rollouts.finished())
        state = {"data_loader": self.loader.state_dict(), "kl_coef": self.kl_ctrl.value,
                 "reward_history": self.reward_history}
        folder = finish_save(self.checkpoint_root, step, state, to_yaml(self.cfg), self.cfg.trainer.keep_last)
        self.tracker.write(f"step {step}: checkpoint saved to {folder} in {time.perf_counter() - start:.1f} s")

    def load_checkpoint(self) -> None:
        resume_dir = self.resume[0]
        rng_restored = all(done for group in self.model_groups for done in group.load_checkpoint(resume_dir))
        self.rollouts.restore(load_rollouts_ahead(resume_dir))
        if self.cfg.trainer.val_only:
            return
        self.tracker.write(f"Resumed from {resume_dir} (step {self.start_step})" + (
            "" if rng_restored else "; the workers' RNG states were saved under another parallel layout (or in the "
            "earlier pickled format, which is not loaded) and start afresh (sampling seeds depend only on "
            "trainer.seed and the step, so rollouts are unaffected)"))

    def _restore_controller_state(self) -> int:
        """The controller's part of the checkpoint to resume from (data position, KL coefficient, rewards); returns
        its step."""
        resume_dir, state = self.resume
        try:
            self.loader.load_state_dict(state["data_loader"])
        except ValueError as err:
            raise CheckpointError(f"Checkpoint '{resume_dir}' cannot resume this run's data: {err}.") from None
        self.kl_ctrl.value, self.reward_history = state["kl_coef"], state["reward_history"]
        return state["step"]

    def _start_workers(self, stack: ExitStack) -> None:
        """The worker groups, the scorer processes and the run's log, closed by `stack`; resumed, and the engines
        given the policy's weights (they start from dummy ones)."""
        cfg = self.cfg
        stack.enter_context(controller_log(logs_dir(self.run_dir)))
        groups = build_workers(cfg, self.hf_config, start_ray(cfg), stack)
        self.groups, self.actor, self.engine_group = groups, groups[Role.ACTOR], groups[Role.ROLLOUT]
        self.critic = groups.get(Role.CRITIC)
        # The groups hosting Megatron models (what a checkpoint saves), each once.
        self.model_groups = list({id(g): g for role, g in groups.items() if role.has_model}.values())
        # Actor updates so far: one a step after the critic's warm-up.
        self.policy_version = max(0, self.start_step - cfg.critic.warmup_steps)
        staleness, gate = cfg.trainer.rollout_staleness, EngineGate()
        self.engines = RolloutEngines(self.engine_group, cfg.trainer.seed,
                                      gate if cfg.rollout.partial_rollout else None,
                                      cfg.rollout.partial_rollout_sync_at_tokens)
        self.engines.weight_version = self.policy_version
        if self.agent_loop is not None:
            stack.callback(self.agent_loop.close)
            self.engines.agent_runner = AgentRunner(self.agent_loop, cfg.rollout.agent_loop, self.engines.serve,
                                                    self.engines.count, self.hf_config["vocab_size"],
                                                    cfg.rollout.multi_turn.turn_synchronous, self.engines.pausing())
        if self.judge is not None:
            self.judge.connect(self.engines, groups)
        self.profiles = StepProfiles(cfg.trainer.profile_steps, groups)
        generate = self.profiles.around("generate", self.generate)  # a profiled step's batch, whenever generated
        fixed_sync_point = cfg.rollout.partial_rollout and cfg.rollout.partial_rollout_sync_at_tokens is not None
        self.rollouts = (Streaming(self.engines, StreamSettings.of(cfg, self.start_step, self.version_training), gate,
                                   self.loader, self.score_now, self.group_filter)
                         if cfg.trainer.async_mode == STREAMING else
                         Ahead(generate, staleness, cfg.trainer.total_steps, gate, cfg.rollout.partial_rollout,
                               self.version_training if fixed_sync_point else None) if staleness else InStep(generate))
        stack.callback(self.rollouts.close)
        self.stop = stack.enter_context(StopSignals())  # after Ray's start: Ray installs a SIGTERM handler of its own
        # A resumed run rewrites the steps after its checkpoint (their old records go); one with nothing to resume
        # starts them afresh (a first start, resume=off, killed before a checkpoint); a validation-only run adds.
        purge_after = None if cfg.trainer.val_only else self.start_step if self.resume else -1
        self.tracker = stack.enter_context(Tracker(cfg, to_dict(cfg), purge_after=purge_after))
        self.records = stack.enter_context(RolloutRecords(cfg.trainer.rollout_data_dir, self.tokenizer, purge_after))
        self.scorer = stack.enter_context(RewardScorer(cfg.reward, cfg.trainer.imports))
        if self.resume:
            self.load_checkpoint()
        sync_weights(self.actor, self.engine_group)

    def _summary(self, done: bool) -> RunSummary:
        steps, trained = len(self.reward_history), not self.cfg.trainer.val_only
        if trained and self.stop.received and not done:
            print(f"Stopped by {self.stop.received} after step {steps}; the same command resumes from its checkpoint.")
        return RunSummary.of(self.reward_history, self.run_dir, self.training_started, self.last_validation,
                             self.start_step)
