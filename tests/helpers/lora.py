"""Shared by the LoRA tests: the ranks' passes through an actor with adapters (run_distributed), and the same adapters
on transformers through PEFT, the single-process reference."""
import dataclasses

import torch

from helpers.parity import build_actor, hf_model, hf_token_log_probs, hf_update_reference
from helpers.routing import owned_outputs

from rl_megatron.models.lora import PEFT_PREFIX


def peft_name(name: str) -> str:
    """'model.layers.0.self_attn.q_proj.lora_A.weight' -> PEFT's parameter of the default adapter."""
    return PEFT_PREFIX + name.removesuffix(".weight") + ".default.weight"


def peft_model(model_dir: str, rank: int, alpha: float, targets: list[str], adapters: dict | None = None,
               seed: int | None = None):
    """transformers + PEFT LoRA on the model folder's weights; its adapters set to `adapters` (the project's names),
    or with `seed` drawn at random (A and B, so that the adapters change the outputs). Returns (model, adapters)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(model_dir), LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                           target_modules=targets))
    params = dict(model.named_parameters())
    names = [n.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight") for n in params if ".lora_" in n]
    if adapters is None:
        g = torch.Generator().manual_seed(seed)
        adapters = {n: 0.1 * torch.randn(params[peft_name(n)].shape, generator=g) for n in names}
    assert set(adapters) == set(names), set(adapters) ^ set(names)
    with torch.no_grad():
        for name, tensor in adapters.items():
            params[peft_name(name)].copy_(tensor)
    return model, adapters


def peft_reference(model, batch, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PEFT's log-probs of `batch`, and its adapters' gradients in the update of `batch` as one mini-batch."""
    with torch.no_grad():
        log_probs, _ = hf_token_log_probs(model, batch.input_ids, cfg.rollout.temperature)
    hf_update_reference(model, batch, cfg)
    grads = {n.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight"): p.grad
             for n, p in model.named_parameters() if p.grad is not None}
    return log_probs, grads


def every_stages_adapters(actor, of_gradients: bool = False) -> dict[str, torch.Tensor]:
    """The whole adapters (or their gradients) of every pipeline stage, on every rank."""
    import torch.distributed as dist

    from rl_megatron.models.lora import adapter_tensors

    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, adapter_tensors(actor.chunks, of_gradients))
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def lora_update_save_update(cfg, batch, adapters, ckpt_dir):
    """`adapters` loaded, one update, a checkpoint, a second update on the same batch: (the adapters saved, the
    second update's metrics, the adapters after it), and the old log-probs both updates used."""
    from rl_megatron.models.lora import load_adapter_tensors

    actor = build_actor(cfg)
    load_adapter_tensors(actor.chunks, adapters)
    old = owned_outputs(actor.log_probs(batch)).log_probs
    batch = dataclasses.replace(batch, old_log_probs=old)
    actor.update(batch)
    saved = every_stages_adapters(actor)
    actor.save_checkpoint(ckpt_dir)
    metrics = actor.update(batch)
    return saved, metrics, every_stages_adapters(actor), old


def lora_resume_update(cfg, batch, ckpt_dir):
    """The checkpoint loaded (at this layout), and the second update of `lora_update_save_update` again: (the
    adapters loaded, the update's metrics, the adapters after it)."""
    actor = build_actor(cfg)
    actor.load_checkpoint(ckpt_dir)
    loaded = every_stages_adapters(actor)
    metrics = actor.update(batch)
    return loaded, metrics, every_stages_adapters(actor)


def lora_passes(cfg, batch, adapters):
    """On each rank: an actor with actor.lora's adapters as initialised (B = 0) and an actor without; then `adapters`
    loaded: log-probs with the adapters, with them disabled, and one update (its metrics, the adapters' gradients,
    the base weights before and after it, and the numbers of parameters the optimizer and the adapters hold)."""
    from megatron.core import parallel_state

    from rl_megatron.models.lora import adapters_disabled, adapters_of, load_adapter_tensors

    plain = owned_outputs(build_actor(dataclasses.replace(
        cfg, actor=dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora, rank=0)))).log_probs(batch))
    actor = build_actor(cfg)
    initial = owned_outputs(actor.log_probs(batch))
    initial_adapters = every_stages_adapters(actor)
    load_adapter_tensors(actor.chunks, adapters)
    adapted = owned_outputs(actor.log_probs(batch))
    with adapters_disabled(actor.chunks):
        disabled = owned_outputs(actor.log_probs(batch))
    base_before = actor.hf_state_dict()
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    metrics = actor.update(dataclasses.replace(batch, old_log_probs=adapted.log_probs).split(dp)[rank])
    grads = every_stages_adapters(actor, of_gradients=True)
    optimized = sum(p.numel() for group in actor.optimizer.param_groups for p in group["params"])
    adapter_numel = sum(p.numel() for a in adapters_of(actor.chunks) for p in a.parameters())
    return (plain, initial, adapted, disabled, metrics, grads, initial_adapters, base_before, actor.hf_state_dict(),
            optimized, adapter_numel)


def lora_sync_into_engine(cfg, adapters_each_sync: list[dict], channel: str, prompts: list[list[int]],
                          new_tokens: int):
    """On each rank: an actor syncs its weights into a real vLLM engine of rollout.tensor_parallel_size, once per
    adapters in `adapters_each_sync` (loaded into the actor first), as the trainer does: the adapted layers merged,
    or the base at the first sync and the adapters alone at each (a vLLM LoRA adapter; `lora_merge_reason`). Returns
    per sync the engine's greedy answers and the adapter bytes it received (0 when merged)."""
    import torch.distributed as dist

    from rl_megatron.rollout.engine import engine_lora_rank
    from rl_megatron.models.lora import load_adapter_tensors
    from rl_megatron.resharding import Resharder
    from rl_megatron.resharding.adapters import AdapterSync
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    actor = build_actor(cfg)
    engine = VLLMEngine(cfg.model.path, cfg.rollout, "float32", seed=dist.get_rank() // cfg.rollout.tensor_parallel_size,
                        lora_rank=engine_lora_rank(cfg))
    served = AdapterSync(actor.chunks, cfg.actor.lora, cfg.model.path, engine, torch.float32,
                         verify=True) if engine_lora_rank(cfg) else None
    out = []
    try:
        resharder = Resharder(*actor.weight_sources(), engine.sync_targets(), bucket_bytes=16 << 10,
                              channel=channel, verify=True)
        for i, adapters in enumerate(adapters_each_sync):
            load_adapter_tensors(actor.chunks, adapters)
            actor.merge_adapters()
            if served is None or i == 0:
                resharder.sync()
                engine.weights_updated()
            received = served.sync() if served else 0
            out.append(([g.response_ids for g in engine.generate(prompts, n=1, temperature=0.0)], received))
        resharder.close()
        return out
    finally:
        if served:
            served.close()
        engine.close()


def vllm_serves_peft_folder(model_dir: str, adapter_dir: str, rollout, rank: int, prompts: list[list[int]]):
    """One vLLM engine over `model_dir`'s own weights serving the PEFT adapter folder `adapter_dir` (of LoRA rank
    `rank`), as a user serves `convert to-peft`'s output: its greedy answers."""
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, rollout, "float32", seed=0, load_format="auto",
                        lora_rank=next(r for r in VLLMEngine.lora_ranks if r >= rank))
    try:
        engine.load_adapter(adapter_dir)
        return [c.response_ids for c in engine.generate(prompts, n=1, temperature=0.0)]
    finally:
        engine.close()
