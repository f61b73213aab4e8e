"""Shared by the offload checks (tests/distributed on gloo at TP=2, tests/gpu on CUDA): an actor whose state goes
to the host and back between two updates, against one that stays; what each check asserts of the round trip."""
import dataclasses

import torch

from helpers.parity import config, make_batch
from rl_megatron.workers.spawn import run_distributed

LAYOUTS = ("shared_params", "private_params")


def _build(cfg):
    from rl_megatron.config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    return MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)


def _tensors_in(value, prefix: str):
    """(path, tensor) of every tensor in nested dicts / lists (an optimizer's state dict holds its own tensors)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, f"{prefix}/{index}")


def _state(actor) -> dict[str, torch.Tensor]:
    """Copies of this rank's parameters, DDP gradients and optimizer state (Adam moments, step), by name."""
    state = {}
    for index, chunk in enumerate(actor.model):
        for name, param in chunk.named_parameters():
            state[f"param/{index}/{name}"] = param.detach().clone()
            state[f"grad/{index}/{name}"] = param.main_grad.clone()
    for path, tensor in _tensors_in(actor.optimizer.state_dict(), "optimizer"):
        state[path] = tensor.clone()
    return state


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(name for name in a.keys() | b.keys()
                  if name not in a or name not in b or not torch.equal(a[name], b[name]))


def _without_grads(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if not name.startswith("grad/")}


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _round_trip(cfg, batches, layouts):
    """Per layout: an actor that goes through offload/reload between two updates, against one that does not."""
    from megatron.core import parallel_state

    from rl_megatron.resharding.shared_params import location
    from rl_megatron.workers.offload import Offloader

    def update(actor, batch):
        # DP=1: every rank takes the whole batch.
        assert parallel_state.get_data_parallel_world_size() == 1
        return actor.update(batch)

    reference = _build(cfg)
    update(reference, batches[0])
    reference_after_first = _state(reference)
    reference_metrics = update(reference, batches[1])
    results = {}
    for layout in layouts:
        actor = _build(cfg)
        params = [p for chunk in actor.model for p in chunk.parameters()]
        shared_at = [location(p) for p in params]
        if layout == "private_params":
            # As on GPU, or on CPU when /dev/shm has no room: every parameter in memory of its own.
            with torch.no_grad():
                for param in params:
                    param.data = param.data.clone()
        update(actor, batches[0])
        before = _state(actor)
        prompts = batches[1].select()
        log_probs_before = actor.log_probs(prompts)
        optimizer_tensors = [tensor for _, tensor in _tensors_in(actor.optimizer.state_dict(), "")]
        offloader = Offloader(actor.model, actor.optimizer)
        to_host = offloader.to_host()
        again = offloader.to_host()  # idempotent: nothing left to move
        freed = {"params": _storage_bytes(params), "grads": _storage_bytes(p.main_grad for p in params),
                 "optimizer": _storage_bytes(optimizer_tensors)}
        # The phase order of a step: params back for the old log-probs (grads and optimizer still away), then the
        # rest for the update.
        offloader.to_device("params")
        log_probs_after = actor.log_probs(prompts)
        offloader.to_device()
        reloaded = _state(actor)
        host_buffers = {key: id(buffer) for key, buffer in offloader._host.items()}
        offloader.to_host()
        offloader.to_device()
        results[layout] = {
            "differ_after_first_update": _differences(before, reference_after_first),
            "moved": to_host.moved, "dropped": to_host.dropped, "kept": to_host.kept,
            "moved_again": again.moved | again.dropped, "freed": freed,
            "optimizer_tensors": len(optimizer_tensors),
            "log_probs": tuple(None if out is None else out.tensors() for out in (log_probs_before, log_probs_after)),
            "after_reload": _differences(_without_grads(reloaded), _without_grads(before)),
            "grads_nonzero_before": any(bool(before[n].any()) for n in before if n.startswith("grad/")),
            "grads_after_reload": [n for n in reloaded if n.startswith("grad/") and bool(reloaded[n].any())],
            "host_buffers_reused": host_buffers == {key: id(buffer) for key, buffer in offloader._host.items()},
            "shared_mapping_kept": [location(p) for p in params] == shared_at,
            "left_off_device": offloader.off_device(),
            "metrics": (update(actor, batches[1]), reference_metrics),
            "after_second_update": _differences(_state(actor), _state(reference)),
        }
    return results


def round_trips(model_dir: str, tp: int, layouts=LAYOUTS) -> list[dict]:
    """Per rank, per layout: what `_round_trip` measured."""
    from rl_megatron.config import read_hf_config

    cfg = config(model_dir, tp=tp, pp=1)
    first = make_batch(read_hf_config(model_dir)["vocab_size"])
    mask = first.response_mask
    first.advantages = first.advantages[:, None] * mask  # per token
    # Old log-probs near the policy's (a tiny random model: about log(1/vocab)), so that some ratios clip.
    first.old_log_probs = (-3.0 + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))) * mask
    second = dataclasses.replace(first, advantages=-first.advantages)
    return run_distributed(_round_trip, world_size=tp, tp=tp, args=(cfg, [first, second], layouts))


def check_offload_frees_the_state_and_restores_it(per_rank: list[dict], layout: str) -> None:
    for rank, results in enumerate(per_rank):
        result = results[layout]
        assert result["differ_after_first_update"] == [], f"rank {rank}: the actors differ before the round trip"
        assert result["optimizer_tensors"] > 0
        # Optimizer state always moves and grads are always dropped (freed, not copied); the parameters move only
        # when they are the actor's own memory.
        assert result["moved"]["optimizer"] > 0 and "grads" not in result["moved"]
        assert result["dropped"] == {"grads": result["dropped"]["grads"]} and result["dropped"]["grads"] > 0
        assert result["moved_again"] == {}
        assert result["freed"]["grads"] == 0 and result["freed"]["optimizer"] == 0
        if layout == "shared_params":
            # In /dev/shm, mapped by the engines of peers: left in place, and still there.
            assert "params" not in result["moved"] and result["kept"]["params"] > 0
            assert result["freed"]["params"] > 0 and result["shared_mapping_kept"]
        else:
            assert result["moved"]["params"] > 0 and result["kept"] == {}
            assert result["freed"]["params"] == 0
        assert result["left_off_device"] == {}
        assert result["host_buffers_reused"]  # a second round trip allocates no new host memory
        before, after = result["log_probs"]  # from the ranks that own them (the first TP rank)
        assert (before is None) == (after is None) == (rank != 0)
        assert rank != 0 or _differences(before, after) == []
        assert result["after_reload"] == [], f"rank {rank}: changed by the round trip"
        # Gradients come back as zeros, as the next mini-batch would zero them anyway.
        assert result["grads_nonzero_before"] and result["grads_after_reload"] == []


def check_update_after_offload_equals_update_without(per_rank: list[dict], layout: str) -> None:
    for rank, results in enumerate(per_rank):
        result = results[layout]
        offloaded_metrics, reference_metrics = result["metrics"]
        assert offloaded_metrics == reference_metrics
        assert offloaded_metrics["actor/grad_norm"] > 0
        assert result["after_second_update"] == [], f"rank {rank}: the next update differs"
