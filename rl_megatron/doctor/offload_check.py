"""The offload round trip (`workers.offload.Offloader`, the GPU hybrid engine's path) on this rank: an actor whose
state goes to the host and back between two updates, against one that stays, and what must hold of it. The doctor
runs it at the device's own layout; tests/distributed (gloo, TP=2) and tests/gpu run it at each layout.

Layouts of the parameters and the optimizer:
  shared_params         CPU's: the parameters in /dev/shm, which the engines map; Megatron's plain optimizer, which
                        holds the parameters themselves;
  private_params        CPU's when /dev/shm lacks room: every parameter in memory of its own, the plain optimizer;
  distributed_optimizer GPU's: DDP moves every parameter into its contiguous buffer and the optimizer's fp32 shards
                        are views of that buffer (so a parameter given other memory would leave the optimizer).
"""
from __future__ import annotations

import dataclasses

import torch

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.config import Config
from rl_megatron.doctor.parity import make_batch, tensor_differences
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.resharding.shared_params import location
from rl_megatron.workers.megatron_actor import MegatronActor
from rl_megatron.workers.offload import Offloader, torch_optimizers

LAYOUTS = ("shared_params", "private_params", "distributed_optimizer")


def device_layout() -> str:
    """The layout an actor has on this machine's device."""
    return "distributed_optimizer" if platform.has_cuda() else "shared_params"


def build_actor(cfg: Config, layout: str) -> MegatronActor:
    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10,
                          distributed_optimizer=layout == "distributed_optimizer")
    if layout == "private_params":
        # Out of /dev/shm: the plain optimizer holds the parameter objects, so it sees their new memory.
        with torch.no_grad():
            for param in _params(actor):
                if location(param) is not None:
                    param.data = param.data.clone()
    return actor


def round_trip_batches(vocab: int) -> list[TrainBatch]:
    """Two batches whose advantages are opposite (per token), with old log-probs near a tiny random model's (about
    log(1/vocab)), so that some ratios clip."""
    first = make_batch(vocab)
    mask = first.response_mask
    first.advantages = first.advantages[:, None] * mask
    first.old_log_probs = (-3.0 + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))) * mask
    return [first, dataclasses.replace(first, advantages=-first.advantages)]


def _params(actor: MegatronActor) -> list[torch.nn.Parameter]:
    return [p for chunk in actor.model for p in chunk.parameters()]


def _optimizer_state(actor: MegatronActor) -> dict[str, torch.Tensor]:
    """The optimizer's master params and state (Adam's moments, step), read through its torch optimizers as the
    Offloader finds them (a distributed optimizer's state_dict() holds no moments)."""
    state = {}
    for part, optimizer in enumerate(torch_optimizers(actor.optimizer)):
        for group_index, group in enumerate(optimizer.param_groups):
            for index, master in enumerate(group["params"]):
                where = f"{part}/{group_index}/{index}"
                state[f"master/{where}"] = master.detach()
                for key, value in optimizer.state.get(master, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"optimizer/{where}/{key}"] = value
    return state


def _state(actor: MegatronActor) -> dict[str, torch.Tensor]:
    """Copies of this rank's parameters, DDP gradients and optimizer state, by name."""
    state = {}
    for index, chunk in enumerate(actor.model):
        for name, param in chunk.named_parameters():
            state[f"param/{index}/{name}"] = param.detach()
            state[f"grad/{index}/{name}"] = param.main_grad
    state.update(_optimizer_state(actor))
    return {name: tensor.clone() for name, tensor in state.items()}


def _without_grads(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if not name.startswith("grad/")}


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def round_trip(cfg: Config, batches: list[TrainBatch], layouts=LAYOUTS) -> dict[str, dict]:
    """Per layout, on this rank (DP=1: every rank takes the whole batch): an actor that goes through
    offload/reload between two updates, against one of the same optimizer that does not."""
    references = {}

    def reference_of(layout: str) -> dict:
        distributed = layout == "distributed_optimizer"
        if distributed not in references:
            reference = build_actor(cfg, layout)
            reference.update(batches[0])
            after_first = _state(reference)
            references[distributed] = {"after_first": after_first, "metrics": reference.update(batches[1]),
                                       "after_second": _state(reference)}
        return references[distributed]

    results = {}
    for layout in layouts:
        reference = reference_of(layout)
        actor = build_actor(cfg, layout)
        params = _params(actor)
        shared_at = [location(p) for p in params]
        actor.update(batches[0])
        before = _state(actor)
        prompts = batches[1].select()
        log_probs_before = actor.log_probs(prompts)
        device = platform.device().type
        optimizer_tensors = [t for name, t in _optimizer_state(actor).items()
                             if name.startswith("optimizer/") and t.device.type == device]
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
            "differ_after_first_update": tensor_differences(before, reference["after_first"]),
            "moved": to_host.moved, "dropped": to_host.dropped, "kept": to_host.kept,
            "moved_again": again.moved | again.dropped, "freed": freed, "optimizer_tensors": len(optimizer_tensors),
            "log_probs": tuple(None if out is None else out.tensors() for out in (log_probs_before, log_probs_after)),
            "after_reload": tensor_differences(_without_grads(reloaded), _without_grads(before)),
            "grads_nonzero_before": any(bool(before[n].any()) for n in before if n.startswith("grad/")),
            "grads_after_reload": [n for n in reloaded if n.startswith("grad/") and bool(reloaded[n].any())],
            "host_buffers_reused": host_buffers == {key: id(buffer) for key, buffer in offloader._host.items()},
            "shared_mapping_kept": [location(p) for p in params] == shared_at,
            "left_off_device": offloader.off_device(),
            "metrics": (actor.update(batches[1]), reference["metrics"]),
            "after_second_update": tensor_differences(_state(actor), reference["after_second"]),
        }
    return results


def offload_problems(per_rank: list[dict], layout: str) -> list[str]:
    """What does not hold of the round trip at `layout` (`round_trip`'s results of every rank; TP rank 0 owns the
    log-probs): the state leaves the device (gradients dropped, not copied; parameters in /dev/shm left in place)
    and comes back bitwise, gradients as zeros, into the same host buffers the next time."""
    problems = []
    for rank, results in enumerate(per_rank):
        result = results[layout]
        moved, dropped, kept, freed = result["moved"], result["dropped"], result["kept"], result["freed"]
        before, after = result["log_probs"]
        if layout == "shared_params":
            params_held = ("params" not in moved and kept.get("params", 0) > 0 and freed["params"] > 0
                           and result["shared_mapping_kept"])
        else:
            params_held = moved.get("params", 0) > 0 and kept == {} and freed["params"] == 0
        checks = [
            (result["differ_after_first_update"] == [],
             f"the actor and its reference differ before the round trip: {result['differ_after_first_update'][:3]}"),
            (result["optimizer_tensors"] > 0, "the optimizer holds no state on the device"),
            (moved.get("optimizer", 0) > 0 and "grads" not in moved,
             f"to_host moved {moved}: the optimizer state must move, the gradients never"),
            (set(dropped) == {"grads"} and dropped["grads"] > 0, f"to_host dropped {dropped}: only gradients"),
            (result["moved_again"] == {}, f"a second to_host moved {result['moved_again']} again"),
            (freed["grads"] == 0 and freed["optimizer"] == 0, f"device bytes left after to_host: {freed}"),
            (params_held, f"the parameters ({layout}): moved {moved.get('params', 0)} B, kept "
                          f"{kept.get('params', 0)} B, {freed['params']} B left on the device"),
            (result["left_off_device"] == {}, f"left off the device after to_device: {result['left_off_device']}"),
            (result["host_buffers_reused"], "a second round trip allocated new host buffers"),
            ((before is None) == (after is None) == (rank != 0), "log-probs not returned by TP rank 0 alone"),
            (before is None or tensor_differences(before, after) == [],
             "the log-probs with the parameters back differ from those before"),
            (result["after_reload"] == [], f"changed by the round trip: {result['after_reload'][:3]}"),
            (result["grads_nonzero_before"] and result["grads_after_reload"] == [],
             f"gradients not zero after the round trip: {result['grads_after_reload'][:3]}"),
        ]
        problems += [f"rank {rank}: {message}" for holds, message in checks if not holds]
    return problems


def update_problems(per_rank: list[dict], layout: str) -> list[str]:
    """What does not hold of the update after the round trip: it equals the update without one."""
    problems = []
    for rank, results in enumerate(per_rank):
        result = results[layout]
        offloaded, reference = result["metrics"]
        if offloaded != reference:
            problems.append(f"rank {rank}: the update's metrics differ from those without the round trip")
        if not offloaded["actor/grad_norm"] > 0:
            problems.append(f"rank {rank}: the update had no gradient")
        if result["after_second_update"]:
            problems.append(f"rank {rank}: the next update differs: {result['after_second_update'][:3]}")
    return problems
