"""The hybrid engine on CUDA: vLLM engines in Ray workers beside the trainer's Megatron shards, weights synced over
NCCL. For a GPU machine with vLLM and Ray installed (the Docker image, requirements-gpu.txt); the tests skip, saying
why, without Ray (the module), CUDA, vLLM or enough GPUs.

    pytest tests/gpu/test_engines_gpu.py -m gpu -v -rA
"""
import dataclasses
import importlib.util
import os
from contextlib import ExitStack

import pytest
import torch

INSTALL = "pip install -r requirements-gpu.txt"
# Before the project's imports, which reach Ray (the workers import it); vLLM they import only when they use it.
pytest.importorskip("ray", reason=f"needs ray ({INSTALL})")

from helpers.runs import train  # noqa: E402
from helpers.weight_sync import check_sync_puts_trainer_weights_into_engines, sync_config  # noqa: E402
from rl_megatron.checkpoint.run import saved_steps  # noqa: E402
from rl_megatron.doctor.cycle import PROMPTS, greedy_with  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=f"needs vllm ({INSTALL})")]


def gpus(count: int):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} GPU(s) on this machine (has {have})")


@gpus(1)
def test_generation_after_a_level_2_sleep_is_synced_first(ray_session, tiny_model_dir, tmp_path):
    """The phase machine with a real engine: every Megatron phase (a forward pass, a checkpoint save) sleeps the
    engine at level 2, which discards its weights; the next generation must sync them again, and then generate what
    transformers generates with the trainer's weights (with stale or discarded weights it generates garbage)."""
    from transformers import AutoTokenizer

    from rl_megatron.batch import Prompt
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.rollout.engine import request_seeds
    from rl_megatron.trainer.workers import build_workers, sync_weights

    cfg = sync_config(tiny_model_dir, "actor.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
                      "resharding.verify=true")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts = [Prompt(ids, "arithmetic", "0") for ids in prompt_ids]
    seeds = request_seeds(0, "val", 0, len(prompts))
    with ExitStack() as stack:
        actor = build_workers(cfg, read_hf_config(tiny_model_dir), 1, stack)["actor"]
        sync_weights(actor, actor)
        state = actor.hf_state_dict()[0]  # a forward phase: the engine sleeps at level 2
        expected = greedy_with(state, tiny_model_dir, prompt_ids)
        assert [s.response_ids for s in actor.generate(prompts, seeds, n=1, temperature=0.0)] == expected
        actor.save_checkpoint(str(tmp_path / "global_step_1"))  # the engine sleeps again; no update
        assert [s.response_ids for s in actor.generate(prompts, seeds, n=1, temperature=0.0)] == expected
        assert actor.engine_mismatches(state) == [[]]


@gpus(1)
def test_adapters_served_by_a_sleeping_engine_generate_as_peft_after_two_steps(ray_session, tiny_model_dir, tmp_path):
    """LoRA served by the engine (actor.lora.merge=false): every Megatron phase sleeps the engine at level 1, which
    keeps the frozen base in host memory, since only the first sync sends it. After each of two training steps (the
    adapters alone synced) and a checkpoint save (another sleep, nothing to sync), the engine holds the base bit for
    bit and answers greedily as transformers + PEFT with the adapters saved (at level 2 the base was discarded and
    the engine answered from garbage)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from rl_megatron import convert
    from rl_megatron.batch import Prompt, TrainBatch
    from rl_megatron.doctor.cycle import NEW_TOKENS, hf_greedy
    from rl_megatron.doctor.parity import hf_model
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.rollout.engine import request_seeds
    from rl_megatron.trainer.workers import build_workers, sync_weights

    full = sync_config(tiny_model_dir, "actor.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1")
    cfg = dataclasses.replace(full, actor=dataclasses.replace(
        full.actor, lora=dataclasses.replace(full.actor.lora, rank=8, alpha=16)))  # all-linear: vLLM serves them
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts = [Prompt(ids, "arithmetic", "0") for ids in prompt_ids]
    seeds = request_seeds(0, "val", 0, len(prompts))
    adapters = []
    with ExitStack() as stack:
        actor = build_workers(cfg, read_hf_config(tiny_model_dir), 1, stack)["actor"]
        sync_weights(actor, actor)  # the base and the adapters
        base = actor.hf_state_dict()[0]  # the frozen base (a forward phase: the first sleep)
        for step in (1, 2):
            samples = actor.generate(prompts * 4, request_seeds(0, "train", step, 4 * len(prompts)), n=cfg.rollout.n,
                                     temperature=cfg.rollout.temperature)
            batch = TrainBatch.from_samples(samples, pad_id=0)
            batch.old_log_probs = actor.log_probs(batch).log_probs
            batch.advantages = torch.ones(len(samples))
            actor.update(batch)
            sync_weights(actor, actor)  # the adapters alone
            step_dir = str(tmp_path / f"global_step_{step}")
            actor.save_checkpoint(step_dir)
            answers = [s.response_ids for s in actor.generate(prompts, seeds, n=1, temperature=0.0)]
            assert actor.engine_mismatches(base) == [[]], step
            adapter_dir = str(tmp_path / f"adapter_{step}")
            assert convert.main(["to-peft", "--ckpt", os.path.join(step_dir, "actor"), "--out", adapter_dir]) == 0
            peft = PeftModel.from_pretrained(hf_model(tiny_model_dir), adapter_dir)
            adapters.append({n: p.detach().clone() for n, p in peft.named_parameters() if ".lora_" in n})
            assert answers == hf_greedy(peft.merge_and_unload(), prompt_ids, NEW_TOKENS), step
    assert any(not torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])  # the second step moved them


@gpus(2)
@pytest.mark.parametrize("engine_tp", [1, 2])
def test_colocated_sync_over_nccl_from_tp2(ray_session, tiny_model_dir, engine_tp):
    """Megatron TP=2 into engines of TP=1 (each rank gathers the other's half: both send and receive in one round)
    and TP=2 (an engine sharded over both workers: vLLM's tensor parallelism in the trainer's processes)."""
    check_sync_puts_trainer_weights_into_engines(tiny_model_dir, f"rollout.tensor_parallel_size={engine_tp}",
                                                 "resharding.verify=true", cpus=2)


@gpus(3)
def test_separate_engine_receives_the_weights_by_nccl_broadcast(ray_session, tiny_model_dir):
    check_sync_puts_trainer_weights_into_engines(tiny_model_dir, "rollout.placement=separate",
                                                 "resharding.verify=true", cpus=3)


@gpus(1)
def test_a_grpo_run_that_saves_every_step_samples_from_the_trained_policy(tmp_path):
    """Three steps, a checkpoint after each: every step's samples come from the engine with the policy's weights (the
    trainer's log-probs of the sampled tokens agree with the engine's), and every checkpoint is complete."""
    _, rows, run_dir = train(tmp_path, "trainer.total_steps=3", "trainer.save_every=1", "trainer.target_reward=null",
                             "actor.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
                             "resharding.verify=true")
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2, 3]
    for row in rows:
        if "mismatch/max_abs_logprob_diff" in row:
            assert row["mismatch/max_abs_logprob_diff"] < 0.05, row  # O(1) or more with discarded weights
    assert saved_steps(os.path.join(run_dir, "checkpoints"))[0] == 3
