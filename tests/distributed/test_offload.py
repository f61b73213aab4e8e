"""Offloading the trainer's state between phases (the GPU hybrid engine's path), exercised on CPU over gloo at TP=2:
after an update, params and optimizer state go to host buffers and their storages are freed, gradients are freed
without a copy; params and optimizer state come back bitwise, gradients as zeros, a second round trip reuses the
same host buffers, and the next update is the one the same actor makes without the round trip."""
import dataclasses

import pytest
import torch

from helpers.parity import config, make_batch
from rl_megatron.workers.spawn import run_distributed

TP = 2
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


def _round_trip(cfg, batches):
    """Per layout: an actor that goes through offload/reload between two updates, against one that does not."""
    from megatron.core import parallel_state

    from rl_megatron.resharding.shared_params import location
    from rl_megatron.workers.offload import Offloader

    def update(actor, batch):
        # DP=1 at TP=2: every rank takes the whole batch.
        assert parallel_state.get_data_parallel_world_size() == 1
        return actor.update(batch)

    reference = _build(cfg)
    update(reference, batches[0])
    reference_after_first = _state(reference)
    reference_metrics = update(reference, batches[1])
    results = {}
    for layout in LAYOUTS:
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


@pytest.fixture(scope="module")
def round_trips(tiny_model_dir):
    from rl_megatron.config import read_hf_config

    cfg = config(tiny_model_dir, tp=TP, pp=1)
    first = make_batch(read_hf_config(tiny_model_dir)["vocab_size"])
    mask = first.response_mask
    first.advantages = first.advantages[:, None] * mask  # per token
    # Old log-probs near the policy's (a tiny random model: about log(1/vocab)), so that some ratios clip.
    first.old_log_probs = (-3.0 + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))) * mask
    second = dataclasses.replace(first, advantages=-first.advantages)
    return run_distributed(_round_trip, world_size=TP, tp=TP, args=(cfg, [first, second]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_frees_the_state_and_restores_it_bitwise(round_trips, layout):
    for rank, results in enumerate(round_trips):
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_after_offload_equals_update_without(round_trips, layout):
    for rank, results in enumerate(round_trips):
        result = results[layout]
        offloaded_metrics, reference_metrics = result["metrics"]
        assert offloaded_metrics == reference_metrics
        assert offloaded_metrics["actor/grad_norm"] > 0
        assert result["after_second_update"] == [], f"rank {rank}: the next update differs"


def _engine_phase_switch(cfg):
    """The calls the trainer makes around a generation, on a CPU engine: accepted, and the engine unchanged."""
    from rl_megatron.config import read_hf_config
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(cfg.model.path, cfg.rollout, "float32", seed=0,
                        eos_token_id=read_hf_config(cfg.model.path)["eos_token_id"])
    try:
        prompts = [[5, 6, 7], [8, 9]]
        before = [g.response_ids for g in engine.generate(prompts, n=1, temperature=0.0)]
        weights = {name: p.clone() for name, p in engine.model().named_parameters()}
        errors = []
        for bad_call in (lambda: engine.sleep(level=3), lambda: engine.wake_up(("weights", "cache"))):
            try:
                bad_call()
            except ValueError as error:
                errors.append(str(error))
        engine.sleep()
        engine.wake_up(("weights",))
        engine.wake_up()
        after = [g.response_ids for g in engine.generate(prompts, n=1, temperature=0.0)]
        unchanged = all(torch.equal(weights[name], p) for name, p in engine.model().named_parameters())
        return before, after, unchanged, errors, engine.asleep
    finally:
        engine.close()


def test_engine_sleep_and_wake_up_are_accepted_and_change_nothing_on_cpu(tiny_model_dir):
    """On CPU vLLM has no sleep mode: the trainer still calls them between phases, and bad arguments still fail."""
    [(before, after, unchanged, errors, asleep)] = run_distributed(_engine_phase_switch, world_size=1,
                                                                   args=(config(tiny_model_dir, tp=1, pp=1),))
    assert before == after and all(before) and unchanged and asleep == set()
    assert "sleep(level=3): use 1" in errors[0]
    assert "['cache'] unknown" in errors[1]
