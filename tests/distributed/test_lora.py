"""LoRA adapters (actor.lora, rl_megatron/models/lora.py) on Megatron's tensor-parallel layers, held to PEFT's LoRA on
transformers with the same weights and adapters: the log-probs, and every adapter's gradient in an update, at TP=2
(column- and row-parallel layers, the fused QKV with grouped queries and its biases, the fused gate/up; sequence
parallelism and packed rows), at PP=2 x VPP=2 on a subset of the modules, and on an MoE model's attention at EP=2 with
full recomputation. At initialisation (B = 0) and with the adapters disabled, the model is exactly the base model;
only the adapters train."""
import dataclasses
import json

import pytest
import torch
from peft import PeftModel

from helpers.lora import (lora_passes, lora_resume_update, lora_sync_into_engine, lora_update_save_update, peft_model,
                          peft_reference, vllm_serves_peft_folder)
from helpers.ranks import NEW_TOKENS, PROMPTS
from helpers.parity import config, family_model_dir, make_batch
from helpers.worlds import run_distributed
from rl_megatron import convert
from rl_megatron.config.choices import LORA_MODULES, lora_modules
from rl_megatron.planning.lora_memory import lora_parameters
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.lora import PEFT_PREFIX
from rl_megatron.doctor.cycle import hf_greedy
from rl_megatron.doctor.parity import hf_model, saved_checkpoint

RANK, ALPHA = 4, 8.0


RECOMPUTE_FULL = {"actor.recompute_granularity": "full", "actor.recompute_method": "uniform",
                  "actor.recompute_num_layers": 1}


# qwen2: grouped queries, q/k/v biases. qwen3_moe: the experts split over 2 expert-parallel ranks, adapters on the
# attention (the experts take none yet), which is data-parallel over both ranks.
@pytest.mark.parametrize("family,layers,tp,pp,vpp,ep,ranks,targets,extra", [
    ("qwen2", 2, 2, 1, 1, 1, 2, ["all-linear", "lm_head"], {"actor.sequence_packing": True}),
    ("qwen2", 2, 2, 1, 1, 1, 2, ["all-linear", "lm_head"], {"actor.sequence_parallel": False}),
    ("qwen2", 4, 1, 2, 2, 1, 2, ["q_proj", "v_proj", "down_proj"], {"actor.sequence_packing": False}),
    ("qwen3_moe", 2, 1, 1, 1, 2, 2, ["q_proj", "k_proj", "v_proj", "o_proj"], RECOMPUTE_FULL)])
def test_adapters_match_peft_and_only_they_train(tmp_path, family, layers, tp, pp, vpp, ep, ranks, targets, extra):
    """TP=2 (packed rows), with sequence parallelism (GPU's default) and without (a dense model's on CPU): every
    module, the output layer (split over the vocabulary) too.
    PP=2 x VPP=2, padded rows: a subset, each virtual chunk with its own layers' adapters. EP=2 (the attention
    data-parallel over both ranks, each updating on its half of the batch) with every layer recomputed: the MoE
    model's attention."""
    model_dir = family_model_dir(tmp_path / family, family, tied=False, layers=layers)
    modules = [*LORA_MODULES, "lm_head"] if "all-linear" in targets else targets
    model, adapters = peft_model(model_dir, RANK, ALPHA, modules, seed=7)
    cfg = config(model_dir, tp, pp, vpp, **{"actor.lora.rank": RANK, "actor.lora.alpha": ALPHA,
                                            "actor.lora.target_modules": f"[{','.join(targets)}]",
                                            "actor.optim.clip_grad": 0.0, "actor.expert_model_parallel_size": ep,
                                            "trainer.n_gpus_per_node": ranks, **extra})
    batch = make_batch()
    results = run_distributed(lora_passes, ranks, tp, pp, vpp, ep=ep, args=(cfg, batch, adapters))
    plain, initial, adapted, disabled, metrics, grads, initial_adapters, _, _, optimized, adapter_numel = results[-1]
    mask = batch.response_mask.bool()

    # B starts at zero: the adapted model is the base model, bit for bit under sequence parallelism; so is the model
    # with adapters disabled. (Without it, a frozen base's passes round differently from a trainable one's, by
    # a float32 ULP at most: 9.5e-7 seen.)
    assert set(initial_adapters) == set(adapters)
    assert all(torch.count_nonzero(t) == 0 for n, t in initial_adapters.items() if ".lora_B." in n)
    assert all(torch.count_nonzero(t) == t.numel() for n, t in initial_adapters.items() if ".lora_A." in n)
    if cfg.actor.sequence_parallel is False:
        assert max((t.log_probs - plain.log_probs).abs().max() for t in (initial, disabled)) <= 1e-6
    else:
        assert torch.equal(initial.log_probs, plain.log_probs) and torch.equal(disabled.log_probs, plain.log_probs)

    # With the adapters: PEFT's log-probs, and PEFT's gradient for every adapter.
    peft_log_probs, peft_grads = peft_reference(model, dataclasses.replace(batch, old_log_probs=adapted.log_probs),
                                                cfg)
    assert (adapted.log_probs[mask] - plain.log_probs[mask]).abs().max() > 1e-2  # the adapters do something
    assert (adapted.log_probs[mask] - peft_log_probs[mask]).abs().max() <= 1e-5
    assert set(grads) == set(peft_grads) == set(adapters)
    # Gradients sum over every token in another order than PEFT's: within 1e-4 of each tensor's largest entry
    # (1.2e-5 of 0.35 seen).
    for name, grad in peft_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name
    peft_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in peft_grads.values()])).item()
    assert metrics["actor/grad_norm"] == pytest.approx(peft_norm, rel=1e-4)

    # Only the adapters train: the optimizer holds them alone (as many as the memory planner counts), and the base
    # weights stay as loaded.
    assert optimized == adapter_numel
    hf = read_hf_config(model_dir)
    assert adapter_numel == lora_parameters(hf, lora_modules(targets), RANK, tp, pp, vpp)[0]
    saved = saved_checkpoint(model_dir)
    before, after = results[0][7], results[0][8]  # the export, gathered on rank 0
    assert set(before) == set(after) == set(saved)
    assert all(torch.equal(before[n], saved[n]) and torch.equal(after[n], saved[n]) for n in saved)


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_at_another_layout(tmp_path):
    """Saved at TP=2 (sequence parallel) after one update, loaded at TP=1 x PP=2: the same adapters, and the next
    update (Adam's moments and step count restored) lands where the uninterrupted run's did."""
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    _, adapters = peft_model(model_dir, RANK, ALPHA, list(LORA_MODULES), seed=7)
    lora = {"actor.lora.rank": RANK, "actor.lora.alpha": ALPHA}
    batch, ckpt = make_batch(), str(tmp_path / "checkpoint")
    saved, metrics, after, old = run_distributed(lora_update_save_update, 2, 2, 1,
                                                 args=(config(model_dir, 2, 1, **lora), batch, adapters, ckpt))[0]
    assert any(not torch.equal(saved[n], adapters[n]) for n in adapters)  # the first update moved them
    resumed = run_distributed(lora_resume_update, 2, 1, 2, args=(
        config(model_dir, 1, 2, **lora), dataclasses.replace(batch, old_log_probs=old), ckpt))
    loaded, resumed_metrics, resumed_after = resumed[-1]
    assert set(loaded) == set(saved) and all(torch.equal(loaded[n], saved[n]) for n in saved)
    assert resumed_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert all((resumed_after[n] - after[n]).abs().max() <= 1e-6 for n in after)

    # The checkpoint as a PEFT adapter folder (PEFT loads it: the adapters saved; vLLM serves it), and as an HF
    # model with them merged (PEFT's merge of the same adapters).
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    assert convert.main(["to-peft", "--ckpt", ckpt, "--out", adapter_dir, "--tp", "2"]) == 0
    with open(f"{adapter_dir}/adapter_config.json") as f:
        adapter_config = json.load(f)
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(adapter_config["target_modules"]) == sorted(LORA_MODULES)
    peft = PeftModel.from_pretrained(hf_model(model_dir), adapter_dir)
    loaded = {n.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight"): p.detach()
              for n, p in peft.named_parameters() if ".lora_" in n}
    assert set(loaded) == set(saved) and all(torch.equal(loaded[n], saved[n]) for n in saved)
    assert convert.main(["to-hf", "--ckpt", ckpt, "--out", merged_dir, "--pp", "2"]) == 0
    merged_model = peft.merge_and_unload()
    merged, expected = saved_checkpoint(merged_dir), merged_model.state_dict()
    assert set(merged) == set(expected) and all((merged[n] - expected[n]).abs().max() <= 1e-6 for n in merged)
    # vLLM serves the adapter folder on the base model as PEFT's merged model answers.
    rollout = config(model_dir, 1, 1, **{"rollout.max_tokens": NEW_TOKENS}).rollout
    [served] = run_distributed(vllm_serves_peft_folder, 1, args=(model_dir, adapter_dir, rollout, RANK, PROMPTS))
    assert served == hf_greedy(merged_model, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("merge,channel,engine_tp", [(True, "auto", 1), (False, "process_group", 2)])
def test_engines_generate_as_peft_after_each_sync(tmp_path, merge, channel, engine_tp):
    """Trainer at TP=2, two syncs of other adapters into the engines, whose greedy answers after each are those of
    transformers + PEFT with the same adapters (which differ from the base model's). Merged: each sync sends the
    adapted layers with their adapters merged (W + alpha / r B A, computed on the trainer's shards), read in place,
    into an engine per rank. Otherwise into one engine over both ranks (TP=2): the base at the first sync, then the
    adapters alone, the bytes of the whole adapter in fp32, loaded in place as a vLLM LoRA adapter that each shard
    slices (resharding.verify: what the engine loaded is what was sent, bit for bit)."""
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    models = [peft_model(model_dir, RANK, ALPHA, list(LORA_MODULES), seed=seed) for seed in (7, 8)]
    cfg = config(model_dir, 2, 1, **{"actor.lora.rank": RANK, "actor.lora.alpha": ALPHA, "actor.lora.merge": merge,
                                     "rollout.tensor_parallel_size": engine_tp, "rollout.max_tokens": NEW_TOKENS})
    syncs = run_distributed(lora_sync_into_engine, 2, 2, 1,
                            args=(cfg, [adapters for _, adapters in models], channel, PROMPTS, NEW_TOKENS))
    adapter_bytes = sum(t.numel() * 4 for t in models[0][1].values())
    for i, (model, _) in enumerate(models):
        expected = hf_greedy(model.merge_and_unload(), PROMPTS, NEW_TOKENS)
        for rank_syncs in syncs:
            assert rank_syncs[i] == (expected, 0 if merge else adapter_bytes), (i, rank_syncs[i])
    assert syncs[0][0][0] != syncs[0][1][0] != hf_greedy(hf_model(model_dir), PROMPTS, NEW_TOKENS)
