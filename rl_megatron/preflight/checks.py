"""The pre-flight check: everything about a resolved config that can be checked before a process starts.

The trainer (through `load_config`), `python -m rl_megatron.launch prepare [--dry-run]` and configs built in code
all go through `preflight`. Each value has been checked against its rule in config/schema.py by `resolve`; here come
the checks of keys together (the parallel layouts in `layout.py`), and each package checks its own part: the
loggers' optional libraries (`rl_megatron.tracking`), the data files (`rl_megatron.data.section`), the user's code
(`rl_megatron.plugins`: trainer.imports, rollout.function, reward.custom_fn), the model against the layouts
(`rl_megatron.models.checks`; without Transformer Engine, the attention sinks' scores against the memory plan in
`sink_attention.py`), the model against the rollout engine (`RolloutEngine.check_model`), and last the
model folder's tokenizer (`rl_megatron.models.tokenizer`, with the first prompt encoded), the agent loop with its
tools (`rl_megatron.agents`) and the safetensors weights the workers will load (`rl_megatron.models.hf_weights`, from
the files' headers); a teacher's (teacher.model.path) config.json against its layout, its tokenizer against the
policy's and its weights likewise; a reward model's (reward_model.model.path) config.json as a one-score classifier
against its layout, its tokenizer, and its weights with the score head; a judge's (judge.*) template, and its messages
against the judging engines' length (a judge of its own: its config.json, tokenizer and weights). A dry run's plan
(`dry_run.py`) needs none of those files: `files=False` leaves them, the data files and the checkpoint folders to the
launch.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

from rl_megatron import platform
from rl_megatron.agents import build_agent_loop
from rl_megatron.algorithms import ADV_ESTIMATORS, needs_critic
from rl_megatron.config.pools import (scored_while_generating, uses_judge_engines, uses_reference, uses_reward_model,
                                      uses_teacher, worker_pools)
from rl_megatron.config.choices import SINGLE_TURN, STREAMING
from rl_megatron.config.schema import DEFAULT_ROLLOUT_FUNCTION, Config
from rl_megatron.data.section import check_data_section, check_first_prompt_encodes
from rl_megatron.errors import ConfigError
from rl_megatron.roles import Role, roles_name
from rl_megatron.models.hf_config import end_of_sequence_ids, model_config, read_hf_config, role_model_config
from rl_megatron.models.family import FAMILIES
from rl_megatron.models.hf_weights import check_hf_weights
from rl_megatron.models.score_head import check_classifier_config, score_head_shapes
from rl_megatron.models.tokenizer import check_shared_tokenizer, checked_tokenizer, load_tokenizer
from rl_megatron.platform import determinism
from rl_megatron.plugins import import_user_modules, load_callable
from rl_megatron.preflight.layout import check_activations, check_actor_layout, check_model_against_layouts, \
    check_engine_pool, check_hybrid_layers, check_moe_knobs, check_own_model_against_layout, check_role_layouts
from rl_megatron.preflight.sink_attention import check_sink_attention
from rl_megatron.rewards.custom import load_custom_fn
from rl_megatron.rewards.judge import (FIELDS as JUDGE_FIELDS, JUDGE_PATH_KEY, encode_message, judge_engine_settings,
                                       judge_message, template_fields)
from rl_megatron.rollout.engine import engine_class
from rl_megatron.tracking import check_loggers_installed


def preflight(cfg: Config, cuda: bool | None = None, files: bool = True) -> None:
    """Check a resolved config (`rl_megatron.preflight.resolve`); raise ConfigError on the first problem, naming the
    key and the fix. `cuda`: whether the rollout engines run on CUDA (None: where this process has CUDA, as the
    workers started from it do); `files`: also the files the run reads, beyond the config and model.path's
    config.json (the data, the tokenizer, the weights, the checkpoint folders)."""
    _check_trainer(cfg, files)
    check_data_section(cfg.data, files)
    _check_algorithm(cfg)
    _check_reward(cfg)
    _check_asynchronous(cfg)
    _check_profiling(cfg)
    # The user's code imports (each raises a ConfigError naming its key and what is missing).
    import_user_modules(cfg.trainer.imports)
    load_callable(cfg.rollout.function, "rollout.function")
    if cfg.reward.custom_fn is not None:
        load_custom_fn(cfg.reward.custom_fn)
    check_actor_layout(cfg)
    check_role_layouts(cfg)
    check_moe_knobs(cfg)
    hf = model_config(cfg)
    check_model_against_layouts(cfg, hf)
    teacher_hf = role_model_config(cfg, Role.TEACHER, hf) if uses_teacher(cfg) else None
    if teacher_hf is not None:
        check_own_model_against_layout(cfg, Role.TEACHER, teacher_hf)
    reward_hf = role_model_config(cfg, Role.REWARD_MODEL, hf) if uses_reward_model(cfg) else None
    judge_hf = read_hf_config(cfg.judge.model.path, JUDGE_PATH_KEY) if uses_judge_engines(cfg) else None
    if reward_hf is not None:
        check_classifier_config(reward_hf, cfg.reward_model.model.path, "reward_model.model.path")
        check_own_model_against_layout(cfg, Role.REWARD_MODEL, reward_hf)
    check_activations(cfg, hf)
    engines, cuda = engine_class(cfg.rollout.engine), platform.has_cuda() if cuda is None else cuda
    engines.check_model(hf, cuda)
    if judge_hf is not None:  # a judge of its own: its engines serve its model
        engines.check_model(judge_hf, cuda, f"{JUDGE_PATH_KEY}'s config.json")
    # Where this driver has CUDA, so do the workers; TE findable here is the workers' TE (the same install).
    transformer_engine = importlib.util.find_spec("transformer_engine") is not None
    check_hybrid_layers(cfg, hf, platform.has_cuda(), transformer_engine)
    check_sink_attention(cfg, hf, platform.has_cuda(), transformer_engine)
    if not files:
        return
    stop_ids = end_of_sequence_ids(cfg.model.path, hf)  # where the engines stop generating
    # The model folder's files, once its config is known to fit: the trainer reuses the tokenizer loaded here.
    tokenizer = checked_tokenizer(cfg.model.path, hf)
    check_first_prompt_encodes(cfg.data, tokenizer, cfg.model.path)
    build_agent_loop(cfg.rollout, tokenizer, stop_ids, cfg.model.path)  # rollout.agent_loop's class, its tools, the chat template
    _check_initial_weights(cfg, hf)
    if teacher_hf is not None:  # it scores the policy's token ids, with its own weights
        check_shared_tokenizer(tokenizer, cfg.teacher.model.path)
        check_hf_weights(cfg.teacher.model.path, teacher_hf, "teacher.model.path")
    if cfg.judge.enable:
        _check_judge_fits(cfg, tokenizer, judge_hf)
    if judge_hf is not None and judge_hf.get("model_type") in FAMILIES:  # a family of ours: its weights, from headers
        check_hf_weights(cfg.judge.model.path, judge_hf, JUDGE_PATH_KEY)
    if reward_hf is not None:  # its own tokenizer renders what it scores; its score head replaces lm_head
        load_tokenizer(cfg.reward_model.model.path, "reward_model.model.path")
        check_hf_weights(cfg.reward_model.model.path, reward_hf, "reward_model.model.path", output_layer=False,
                         head=score_head_shapes(reward_hf))


def _check_trainer(cfg: Config, files: bool = True) -> None:
    """The loggers, validation, resuming and the initial weights (`files`: the folders to resume or start from
    exist)."""
    t, model = cfg.trainer, cfg.model
    check_creatable_folder(t.run_dir, "trainer.log_dir")
    check_loggers_installed(t.logger)
    if t.deterministic:  # the environment the workers inherit besides what they are handed
        determinism.check_environment(os.environ)
    for key, folder in (("trainer.checkpoint_dir", t.checkpoint_dir), ("trainer.rollout_data_dir", t.rollout_data_dir)):
        if folder is not None:
            check_creatable_folder(folder, key)
    # A built-in data.task validates on its own prompts; data.train_files need data.val_files beside them.
    if (t.val_every or t.val_before_train or t.val_only) and cfg.data.train_files and not cfg.data.val_files:
        asked = "trainer.val_only=true" if t.val_only else (f"trainer.val_every={t.val_every} / "
                                                            f"trainer.val_before_train={t.val_before_train}")
        raise ConfigError(f"{asked} validate on data.val_files, which is empty: set data.val_files (parquet files, "
                          "e.g. from `python -m rl_megatron.data.prepare`)" + (
                              "." if t.val_only else ", or trainer.val_every=0 and trainer.val_before_train=false."))
    if files and t.resume not in ("auto", "off") and not os.path.isdir(t.resume):
        raise ConfigError(f"trainer.resume={t.resume!r} is neither auto, off, nor an existing checkpoint folder "
                          "(e.g. runs/<experiment>/checkpoints/global_step_40).")
    if model.checkpoint is not None:
        if model.random_init:
            raise ConfigError("model.checkpoint and model.random_init=true both say where the initial weights come "
                              "from; keep one.")
        if files and not os.path.isdir(model.checkpoint):
            raise ConfigError(f"model.checkpoint={model.checkpoint!r} is not a folder; make one with `python -m "
                              "rl_megatron.convert from-hf --hf MODEL --out CKPT`.")


def check_creatable_folder(path: str, key: str) -> None:
    """`path` is a folder, or one this process can create: its nearest existing ancestor is a writable folder."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{key}: '{path}' cannot be a folder, because '{existing}' is a file. Point {key} at a "
                          "folder, or move that file away.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: '{path}' is not writable: no permission to write in '{existing}'. Point {key} "
                          "at a folder you can write to.")


def _check_initial_weights(cfg: Config, hf: dict) -> None:
    """The HF weights the workers will load (`models.gpt.load_hf_weights`), from the safetensors headers: the
    policy's and the reference's from model.path, unless model.random_init or model.checkpoint (whose own check
    covers it) gives them; the critic's trunk from critic.model_path, unless model.random_init. Both are built from
    model.path's config.json (`hf`)."""
    model, critic = cfg.model, cfg.critic
    if model.random_init:
        return
    if model.checkpoint is None:
        check_hf_weights(model.path, hf, "model.path")
    if critic.enable and (model.checkpoint is not None or critic.model_path != model.path):
        check_hf_weights(critic.model_path, hf, "critic.model_path", output_layer=False)  # its value head is new


def _check_streaming(cfg: Config) -> None:
    """Streaming admits prompts one by one into the engines' turn scheduler, continued across every weight update."""
    rollout = cfg.rollout
    if rollout.function != DEFAULT_ROLLOUT_FUNCTION:
        raise ConfigError(f"trainer.async_mode=streaming admits prompts one at a time through rollout.agent_loop, but "
                          f"rollout.function={rollout.function} generates whole batches: write your rollout as an "
                          "agent loop (rl_megatron.agents.AgentLoop, docs/agentic-rl.md) or an agent function "
                          "(rollout.agent.function), or set trainer.async_mode=one_step_off.")
    if rollout.partial_rollout_sync_at_tokens is not None:
        raise ConfigError(f"rollout.partial_rollout_sync_at_tokens={rollout.partial_rollout_sync_at_tokens} fixes "
                          "where an update lands in a one-step-off batch; trainer.async_mode=streaming has no batches "
                          "to fix it in: set it to null, or trainer.async_mode=one_step_off.")
    if rollout.multi_turn.turn_synchronous:
        raise ConfigError("rollout.multi_turn.turn_synchronous=true decodes every trajectory's turn as one round, but "
                          "trainer.async_mode=streaming admits trajectories one by one: set one of them otherwise.")


def _check_asynchronous(cfg: Config) -> None:
    """Generation overlapping training needs engines that do not share the trainer's devices."""
    staleness, rollout = cfg.trainer.rollout_staleness, cfg.rollout
    if staleness and rollout.placement == "colocated":
        raise ConfigError(f"trainer.async_mode={cfg.trainer.async_mode} (trainer.rollout_staleness={staleness}) "
                          "generates the next batch while the actor trains, but "
                          "rollout.placement=colocated puts the engines on the actor's devices, which they only get "
                          "between updates (the hybrid engine). Set rollout.placement=separate (with rollout.nnodes and "
                          "rollout.n_gpus_per_node for the engines' devices), or trainer.rollout_staleness=0.")
    if cfg.trainer.async_mode == STREAMING:
        _check_streaming(cfg)
    if rollout.partial_rollout and not staleness:
        raise ConfigError("rollout.partial_rollout=true continues samples across weight updates, which only arrive "
                          "mid-generation when the rollout runs ahead of the trainer: set trainer.rollout_staleness=1 "
                          "(with rollout.placement=separate), or rollout.partial_rollout=false.")
    sync_at = rollout.partial_rollout_sync_at_tokens
    if sync_at is not None and not rollout.partial_rollout:
        raise ConfigError(f"rollout.partial_rollout_sync_at_tokens={sync_at} places the weight update inside the "
                          "samples of a partial rollout, but rollout.partial_rollout=false: set "
                          "rollout.partial_rollout=true, or rollout.partial_rollout_sync_at_tokens=null.")
    if sync_at is not None and staleness != 1:
        # At N > 1 a batch starts after the one before it, which awaits an update of its own: its first tokens' version
        # would be the schedulers' timing again.
        raise ConfigError(f"rollout.partial_rollout_sync_at_tokens={sync_at} fixes where the weight update lands for "
                          f"one-step-off training only, but trainer.rollout_staleness={staleness}: set "
                          "trainer.rollout_staleness=1, or rollout.partial_rollout_sync_at_tokens=null.")
    if sync_at is not None and sync_at >= rollout.max_tokens:
        raise ConfigError(f"rollout.partial_rollout_sync_at_tokens={sync_at} would never land inside a sample of "
                          f"rollout.max_tokens={rollout.max_tokens} tokens: set it "
                          + (f"between 1 and {rollout.max_tokens - 1}." if rollout.max_tokens > 1 else
                             "to null, or raise rollout.max_tokens."))
    if rollout.partial_rollout and rollout.multi_turn.turn_synchronous:
        raise ConfigError("rollout.multi_turn.turn_synchronous=true decodes every trajectory's turn as one round, "
                          "but rollout.partial_rollout=true interrupts and continues requests one by one; set one of "
                          "them to false.")


def _check_profiling(cfg: Config) -> None:
    """The steps to profile are steps of the run, and some worker group has each rank that records them."""
    t = cfg.trainer
    if not t.profile_steps:
        return
    outside = [step for step in t.profile_steps if not 1 <= step <= t.total_steps]
    if outside:
        raise ConfigError(f"trainer.profile_steps={t.profile_steps}: {outside} not steps of this run, which counts "
                          f"them from 1 to trainer.total_steps={t.total_steps}; choose steps in that range.")
    pools = worker_pools(cfg)
    largest = max(pool.world_size for pool in pools)
    missing = [rank for rank in t.profile_ranks if not 0 <= rank < largest]
    if missing or not t.profile_ranks:
        why = f"{missing} is in no worker group" if missing else "no rank records trainer.profile_steps"
        sizes = ", ".join(f"{roles_name(pool.roles)}: {pool.world_size}" for pool in pools)
        raise ConfigError(f"trainer.profile_ranks={t.profile_ranks}: {why} (workers per group: {sizes}). Choose "
                          f"ranks from 0 to {largest - 1}, e.g. trainer.profile_ranks=[0].")


def _check_algorithm(cfg: Config) -> None:
    """Combinations of the RL algorithm's settings that cannot work."""
    alg, c = cfg.algorithm, cfg.critic
    if alg.kl_ctrl.type == "adaptive" and not alg.use_kl_in_reward:
        raise ConfigError("algorithm.kl_ctrl.type=adaptive steers the in-reward KL penalty, which is off: set "
                          "algorithm.use_kl_in_reward=true, or algorithm.kl_ctrl.type=fixed.")
    if needs_critic(alg.adv_estimator) and not c.enable:
        critic_free = [name for name in ADV_ESTIMATORS.names() if not needs_critic(name)]
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} needs a critic (value estimates), but "
                          "critic.enable=false: set critic.enable=true, or use a critic-free estimator "
                          f"({', '.join(critic_free)}).")
    if c.enable and not needs_critic(alg.adv_estimator):
        raise ConfigError(f"critic.enable=true, but algorithm.adv_estimator={alg.adv_estimator} uses no values: the "
                          "critic would train for nothing. Use algorithm.adv_estimator=gae, or critic.enable=false.")
    if alg.filter_groups.enable and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable=true keeps the prompts whose samples score differently, "
                          f"but rollout.n={cfg.rollout.n} gives each prompt one sample: set rollout.n to 2 or more "
                          "(DAPO: 16).")
    if alg.filter_groups.enable and cfg.data.gen_batch_size < cfg.data.train_batch_size:
        raise ConfigError(f"data.gen_batch_size={cfg.data.gen_batch_size} is below data.train_batch_size="
                          f"{cfg.data.train_batch_size}: dynamic sampling draws at least a train batch of prompts per "
                          "round (DAPO draws 3x). Raise data.gen_batch_size, or leave it unset.")
    if cfg.data.gen_batch_size != cfg.data.train_batch_size and not alg.filter_groups.enable:
        raise ConfigError(f"data.gen_batch_size={cfg.data.gen_batch_size} differs from data.train_batch_size="
                          f"{cfg.data.train_batch_size}, but only dynamic sampling generates more prompts than it "
                          "trains on: set algorithm.filter_groups.enable=true, or leave data.gen_batch_size unset.")
    if c.warmup_steps and not c.enable:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} delays the actor for a critic that this run does not "
                          "have (it needs algorithm.adv_estimator=gae); set critic.warmup_steps=0.")
    if c.warmup_steps >= cfg.trainer.total_steps:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} leaves the actor no step of the "
                          f"trainer.total_steps={cfg.trainer.total_steps}; lower it.")
    if cfg.ref.placement == "separate" and not uses_reference(cfg):
        raise ConfigError("ref.placement=separate asks for reference workers, but nothing uses the reference: set "
                          "actor.use_kl_loss=true or algorithm.use_kl_in_reward=true, or ref.placement=colocated.")
    if cfg.ref.placement == "separate" and cfg.model.random_init:
        raise ConfigError("ref.placement=separate loads the reference from model.path's weights, but "
                          "model.random_init=true (the initial policy exists only in the actor's workers); use "
                          "ref.placement=colocated.")
    if c.placement == "separate" and not c.enable:
        raise ConfigError("critic.placement=separate asks for critic workers, but this run has no critic "
                          "(algorithm.adv_estimator is not gae); set critic.placement=colocated.")
    _check_distillation(cfg)


def _check_distillation(cfg: Config) -> None:
    """The distillation keys need a teacher, and distillation alone trains on no task advantage (no critic, no
    in-reward KL penalty)."""
    distillation, teacher = cfg.algorithm.distillation, cfg.teacher
    if not uses_teacher(cfg):
        keys = _set_keys(distillation, "algorithm.distillation") + _set_keys(teacher, "teacher", ("placement",))
        _refuse_set_keys(keys, "there is no teacher (teacher.model.path=null)",
                         "set teacher.model.path to the teacher's Hugging Face folder (with the policy's tokenizer)")
        return
    if distillation.mode == "alone" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.use_kl_in_reward=true takes the KL penalty off the rewards, which "
                          "algorithm.distillation.mode=alone does not train on: use actor.use_kl_loss=true for a KL "
                          "term, or algorithm.distillation.mode=mixed.")
    if distillation.mode == "alone" and needs_critic(cfg.algorithm.adv_estimator):
        raise ConfigError(f"algorithm.distillation.mode=alone trains on the distillation term only, but "
                          f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains a critic for the task's "
                          "advantages, which would then train for nothing: use algorithm.adv_estimator=grpo (any "
                          "critic-free one), or algorithm.distillation.mode=mixed.")


def _check_reward_model(cfg: Config) -> None:
    """The reward model's keys need its folder; where groups are scored as they generate, workers of its own."""
    if not uses_reward_model(cfg):
        _refuse_set_keys(_set_keys(cfg.reward_model, "reward_model", ("coef", "mode", "placement")),
                         "there is no reward model (reward_model.model.path=null)",
                         "set reward_model.model.path to a sequence classifier's Hugging Face folder")
        return
    if cfg.reward_model.placement != "separate":
        _check_scored_after_generation(cfg, "a reward model in the actor's workers (reward_model.placement=colocated) "
                                            "scores in the step's Megatron passes, after generation",
                                       "set reward_model.placement=separate (its own workers score each group as it "
                                       "is generated)")


def _check_judge(cfg: Config) -> None:
    """The judge's keys need a judge, its template names only the fields it is given; streaming, engines of its own."""
    judge = cfg.judge
    if not judge.enable:
        _refuse_set_keys(_set_keys(judge, "judge") + _set_keys(judge.model, "judge.model"), "judge.enable=false",
                         "set judge.enable=true to judge the samples")
        return
    if judge.model.path is not None:
        check_engine_pool("judge", judge)
    else:
        _refuse_set_keys(_set_keys(judge, "judge", ("nnodes", "n_gpus_per_node", "tensor_parallel_size",
                                                    "gpu_memory_utilization", "max_model_len")),
                         "judge.model.path=null makes the policy's engines the judge (no engines of its own)",
                         "set judge.model.path to the judge's Hugging Face folder")
    unknown = sorted(template_fields(judge.prompt_template) - set(JUDGE_FIELDS))
    if unknown:
        raise ConfigError(f"judge.prompt_template names {{{unknown[0]}}}, but a judge's message is filled with "
                          f"{', '.join('{' + name + '}' for name in JUDGE_FIELDS)} only: use those, or write a literal "
                          "brace as {{ or }}.")
    if judge.model.path is None:
        _check_scored_after_generation(cfg, "a self-judge (judge.model.path=null) judges on the engines streaming "
                                            "keeps generating", "set judge.model.path to a judge of its own",
                                       dynamic_sampling=False)


def _check_judge_fits(cfg: Config, tokenizer, judge_hf: dict | None) -> None:
    """The engines that judge (the policy's, or a judge's own: `judge_hf`, its config.json) take the judge's message
    (the template's own tokens, the longest prompt and response) and its verdict: within their max_model_len, or the
    longest samples could not be judged."""
    r, judge = cfg.rollout, cfg.judge
    if judge_hf is None:
        engines, length_key, length = "the policy's engines", "rollout.max_model_len", r.max_model_len
    else:
        tokenizer = load_tokenizer(judge.model.path, JUDGE_PATH_KEY)
        length = judge_engine_settings(cfg, judge_hf).max_model_len
        engines, length_key = "the judge's engines", "judge.max_model_len"
    template = len(encode_message(tokenizer, judge_message(judge.prompt_template, "", "", "")))
    single_turn = r.agent_loop == SINGLE_TURN and r.agent.function is None
    response = r.max_tokens if single_turn else r.multi_turn.max_response_length
    needed = template + cfg.data.max_prompt_length + response + judge.max_tokens
    if needed > length:
        raise ConfigError(f"judge.enable=true sends {engines} messages of up to {needed} tokens with the verdict (the "
                          f"template's {template}, data.max_prompt_length={cfg.data.max_prompt_length}, a response of "
                          f"up to {response} and judge.max_tokens={judge.max_tokens}), past {length_key}={length}: set "
                          f"{length_key}={needed} (or more), or shorten the template or judge.max_tokens.")


def _set_keys(section, prefix: str, names: tuple[str, ...] | None = None) -> list[str]:
    """The keys of `section` (a config dataclass at `prefix`; only `names` when given) set to other than their
    defaults."""
    return [f"{prefix}.{f.name}" for f in dataclasses.fields(section) if (names is None or f.name in names)
            and f.default is not dataclasses.MISSING and getattr(section, f.name) != f.default]


def _refuse_set_keys(keys: list[str], missing: str, fix: str) -> None:
    """ConfigError for the first of `keys` when any is set: they need what is `missing`; `fix` provides it."""
    if keys:
        raise ConfigError(f"{keys[0]} is set, but {missing}: {fix}, or remove {keys[0]}.")


def _check_scored_after_generation(cfg: Config, why: str, off: str, dynamic_sampling: bool = True) -> None:
    """A model that scores a batch after its rollout cannot serve the modes that score each group as it generates
    (streaming; and dynamic sampling, unless the model scores each of its rounds: `dynamic_sampling` False).
    ConfigError saying `why` and naming both ways out (`off` turns the model off)."""
    scored_early = scored_while_generating(cfg, dynamic_sampling)
    if scored_early:
        raise ConfigError(f"{scored_early[0]} scores each prompt's group while it generates, but {why}: turn "
                          f"{scored_early[0].split('=')[0]} off, or {off}.")


def _check_reward(cfg: Config) -> None:
    """The overlong buffer must leave room for responses it does not penalise; the reward model's keys."""
    _check_reward_model(cfg)
    _check_judge(cfg)
    buffer, max_tokens = cfg.reward.overlong_buffer, cfg.rollout.max_tokens
    if buffer.enable and buffer.len >= max_tokens:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len} must be below rollout.max_tokens={max_tokens}: "
                          "the penalty grows over the last len tokens before max_tokens, so a buffer that long "
                          "would penalise responses of any length. Lower reward.overlong_buffer.len (DAPO: 4096 of "
                          "20480), raise rollout.max_tokens, or set reward.overlong_buffer.enable=false.")
