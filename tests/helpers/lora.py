"""Shared by the LoRA tests: the ranks' passes through an actor with adapters (run_distributed), and the same adapters
on transformers through PEFT, the single-process reference."""
import dataclasses

import torch

from helpers.parity import build_actor, hf_model, hf_token_log_probs, hf_update_reference
from helpers.routing import owned_outputs

PEFT_PREFIX = "base_model.model."  # PEFT's names: the project's, under the wrapped model, with the adapter's name


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
        adapters = {n: 0.3 * torch.randn(params[peft_name(n)].shape, generator=g) for n in names}
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


def lora_passes(cfg, batch, adapters):
    """On each rank: an actor with actor.lora's adapters as initialised (B = 0) and an actor without; then `adapters`
    loaded: log-probs with the adapters, with them disabled, and one update (its metrics, the adapters' gradients,
    the base weights before and after it, and the numbers of parameters the optimizer and the adapters hold)."""
    import torch.distributed as dist

    from rl_megatron.models.lora import adapter_tensors, adapters_disabled, adapters_of, load_adapter_tensors

    plain = owned_outputs(build_actor(dataclasses.replace(
        cfg, actor=dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora, rank=0)))).log_probs(batch))
    actor = build_actor(cfg)
    initial = owned_outputs(actor.log_probs(batch))
    initial_adapters = adapter_tensors(actor.chunks)
    load_adapter_tensors(actor.chunks, adapters)
    adapted = owned_outputs(actor.log_probs(batch))
    with adapters_disabled(actor.chunks):
        disabled = owned_outputs(actor.log_probs(batch))
    base_before = actor.hf_state_dict()
    metrics = actor.update(dataclasses.replace(batch, old_log_probs=adapted.log_probs))
    grads = adapter_tensors(actor.chunks, of_gradients=True)
    every_stage = [None] * dist.get_world_size()
    dist.all_gather_object(every_stage, (initial_adapters, grads))
    initial_adapters = {n: t for stage, _ in every_stage for n, t in stage.items()}
    grads = {n: t for _, stage in every_stage for n, t in stage.items()}
    optimized = sum(p.numel() for group in actor.optimizer.param_groups for p in group["params"])
    adapter_numel = sum(p.numel() for a in adapters_of(actor.chunks) for p in a.parameters())
    return (plain, initial, adapted, disabled, metrics, grads, initial_adapters, base_before, actor.hf_state_dict(),
            optimized, adapter_numel)
