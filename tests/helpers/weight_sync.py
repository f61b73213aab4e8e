"""Shared by the weight-sync checks (tests/integration on CPU, tests/gpu over NCCL): Ray workers hosting the actor's
Megatron shards and vLLM engines; the engines must hold exactly the trainer's weights and generate what
`transformers` generates with them, before and after an update."""
from contextlib import ExitStack

import torch

from helpers.parity import hf_greedy

PROMPTS = ["3+4=", "1+1=", "0+9=", "5+2="]
NEW_TOKENS = 6


def greedy_with(state: dict, model_dir: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy answers with the weights `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.load_state_dict(state)
    return hf_greedy(model, prompt_ids, NEW_TOKENS)


def sync_config(model_dir: str, *overrides: str):
    from rl_megatron.config import load_config

    return load_config("configs/demo_cpu.yaml", [f"model.path={model_dir}", "model.random_init=false",
                                                f"rollout.max_tokens={NEW_TOKENS}", "actor.optim.lr=0.05",
                                                "data.train_batch_size=16", *overrides])


def check_sync_puts_trainer_weights_into_engines(model_dir: str, *overrides: str, cpus: int = 2) -> None:
    """Sync, compare every engine's weights and greedy output with the trainer's; one large update; again."""
    from transformers import AutoTokenizer

    from rl_megatron.batch import Prompt, TrainBatch
    from rl_megatron.config import read_hf_config
    from rl_megatron.rollout.vllm_engine import request_seeds
    from rl_megatron.trainer.workers import build_workers, sync_weights

    cfg = sync_config(model_dir, *overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts = [Prompt(ids, "arithmetic", "0") for ids in prompt_ids]
    with ExitStack() as stack:
        workers = build_workers(cfg, read_hf_config(model_dir), cpus, stack)
        actor, rollout = workers["actor"], workers["rollout"]
        assert (rollout is actor) == (cfg.rollout.placement == "colocated")
        engine_workers = len(rollout.workers)
        sync_weights(actor, rollout)
        state = actor.hf_state_dict()[0]
        assert rollout.engine_mismatches(state) == [[]] * engine_workers
        seeds = request_seeds(0, "val", 0, len(prompt_ids))
        # The trainer's validation sampling: rollout.val_n answers per prompt, greedy for one.
        val_n = cfg.rollout.val_n
        validation = dict(n=val_n, temperature=0.0 if val_n == 1 else cfg.rollout.temperature)
        before = [s.response_ids for s in rollout.generate(prompts, seeds, **validation)]
        assert before == greedy_with(state, model_dir, prompt_ids)

        # One large update that pushes up every sampled token's probability, then sync again.
        samples = rollout.generate(prompts * 4, request_seeds(0, "train", 1, 4 * len(prompts)), n=cfg.rollout.n,
                                   temperature=cfg.rollout.temperature)
        batch = TrainBatch.from_samples(samples, pad_id=0)
        batch.old_log_probs = actor.log_probs(batch).log_probs
        # The engine sampled from the distribution the trainer computes.
        gap = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.response_mask
        assert gap.max() < 1e-5
        batch.advantages = torch.ones(len(samples))
        actor.update(batch)
        sync_weights(actor, rollout)
        new_state = actor.hf_state_dict()[0]
        assert any(not torch.equal(state[n], new_state[n]) for n in state)
        assert rollout.engine_mismatches(new_state) == [[]] * engine_workers
        after = [s.response_ids for s in rollout.generate(prompts, seeds, **validation)]
        assert after == greedy_with(new_state, model_dir, prompt_ids)
        assert after != before
