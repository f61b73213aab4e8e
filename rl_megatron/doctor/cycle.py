"""A tiny model's whole cycle through the real workers: Megatron shards in Ray workers, vLLM engines (colocated or
separate, at the config's rollout TP), weights synced into the engines, checked byte for byte, and generation
compared with transformers' greedy output on the trainer's own weights, before and after an update (on GPU each
forward pass sleeps the engine at level 2, so the second generation also proves the sync after a sleep). The doctor
runs it; the CPU integration test and the GPU tests call it too."""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from rl_megatron.batch import Prompt, TrainBatch
from rl_megatron.config.schema import Config
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.preflight import load_config
from rl_megatron.rollout.engine import request_seeds
from rl_megatron.trainer.workers import build_workers, sync_weights

PROMPTS = ["3+4=", "1+1=", "0+9=", "5+2="]  # the tiny digits model's own task
NEW_TOKENS = 6


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, eos: int = 2) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, up to and including the first EOS."""
    outputs = []
    for ids in prompts:
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=0)[0, len(ids):].tolist()
        outputs.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return outputs


def greedy_with(state: dict, model_dir: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy answers with the weights `state` (HF checkpoint names: loaded as from a folder, so that
    transformers fuses per-expert tensors into its MoE layers' stacks as it does there)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(model_dir)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, config=config, state_dict=state,
                                                                      dtype=torch.float32)
    return hf_greedy(model, prompt_ids, NEW_TOKENS)


def cycle_config(cfg: Config, model_dir: str) -> Config:
    """The tiny model at `model_dir` in the parts of `cfg` that decide the GPU paths: the rollout placement and TP,
    the actor's TP (at most 2: the tiny model has 2 heads), the weight sync's channel and buckets, the Ray cluster.
    Everything else is the demo's (float32, so that transformers' greedy output is the reference)."""
    tp, engine_tp = min(cfg.actor.tensor_model_parallel_size, 2), min(cfg.rollout.tensor_parallel_size, 2)
    separate = cfg.rollout.placement == "separate"
    return load_config(None, [
        f"model.path={model_dir}", "model.random_init=false", "model.make_vocab_size_divisible_by=1",
        "trainer.nnodes=1", f"trainer.n_gpus_per_node={tp if separate else max(tp, engine_tp)}",
        f"actor.tensor_model_parallel_size={tp}", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=64",
        "actor.optim.lr=0.05", f"rollout.placement={cfg.rollout.placement}", "rollout.nnodes=1",
        f"rollout.n_gpus_per_node={engine_tp}", f"rollout.tensor_parallel_size={engine_tp}", "rollout.n=8",
        f"rollout.max_tokens={NEW_TOKENS}", "data.task=arithmetic", "data.train_batch_size=16",
        "data.max_prompt_length=8", f"resharding.channel={cfg.resharding.channel}",
        f"resharding.bucket_mb={cfg.resharding.bucket_mb}", "resharding.verify=true",
        f"ray.address={cfg.ray.address or 'null'}"])


@dataclass
class CycleReport:
    problems: list[str]  # empty when every check held
    engines: int  # engine workers checked
    max_log_prob_gap: float  # the trainer's log-probs of the sampled tokens against the engine's


def weight_cycle(cfg: Config, cpus: int) -> CycleReport:
    """Sync → compare every engine's weights and greedy output with the trainer's → one large update → again.
    `cfg.model.path` is a model folder with weights (the tiny one: its prompts are digits)."""
    from transformers import AutoTokenizer

    model_dir = cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts = [Prompt(ids, "arithmetic", "0") for ids in prompt_ids]
    problems = []
    with ExitStack() as stack:
        workers = build_workers(cfg, read_hf_config(model_dir), cpus, stack)
        actor, rollout = workers["actor"], workers["rollout"]
        engines = len(rollout.workers)
        seeds = request_seeds(0, "val", 0, len(prompt_ids))
        # The trainer's validation sampling: rollout.val_n answers per prompt, greedy for one.
        validation = dict(n=cfg.rollout.val_n, temperature=0.0 if cfg.rollout.val_n == 1 else cfg.rollout.temperature)

        def check(when: str) -> tuple[dict, list[list[int]]]:
            sync_weights(actor, rollout)
            state = actor.hf_state_dict()[0]  # a forward pass: on GPU the engine sleeps, discarding its weights
            wrong = [bad for per_engine in rollout.engine_mismatches(state) for bad in per_engine]
            if wrong:
                problems.append(f"{when}: {len(wrong)} engine tensor(s) differ from the trainer's, first {wrong[0]}")
            answers = [s.response_ids for s in rollout.generate(prompts, seeds, **validation)]
            if answers != greedy_with(state, model_dir, prompt_ids):
                problems.append(f"{when}: the engines' greedy answers differ from transformers' on the same weights")
            return state, answers

        state, before = check("after the first sync")
        # One large update that pushes up every sampled token's probability, then sync again.
        samples = rollout.generate(prompts * 4, request_seeds(0, "train", 1, 4 * len(prompts)), n=cfg.rollout.n,
                                   temperature=cfg.rollout.temperature)
        batch = TrainBatch.from_samples(samples, pad_id=0)
        batch.old_log_probs = actor.log_probs(batch).log_probs
        gap = float(((batch.old_log_probs - batch.rollout_log_probs).abs() * batch.response_mask).max())
        batch.advantages = torch.ones(len(samples))
        actor.update(batch)
        new_state, after = check("after an update")
        if all(torch.equal(state[name], new_state[name]) for name in state):
            problems.append("the update changed no weight")
        elif after == before:
            problems.append("the engines' answers did not change with the weights")
    return CycleReport(problems, engines, gap)
