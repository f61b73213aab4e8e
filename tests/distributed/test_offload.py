"""Offloading the trainer's state between phases (the GPU hybrid engine's path), exercised on CPU over gloo at TP=2:
after an update, params and optimizer state go to host buffers and their storages are freed, gradients are freed
without a copy; params and optimizer state come back bitwise, gradients as zeros, a second round trip reuses the
same host buffers, and the next update is the one the same actor makes without the round trip. Each layout of
rl_megatron/doctor/offload_check.py: CPU's (parameters in /dev/shm, or private), and GPU's distributed optimizer
(fp32 shards viewing DDP's parameter buffer), which Megatron builds on gloo too."""
import pytest
import torch

from helpers.offload import round_trips
from helpers.parity import config
from rl_megatron.doctor.offload_check import LAYOUTS, offload_problems, update_problems
from helpers.worlds import run_distributed

TP = 2


@pytest.fixture(scope="module")
def trips(tiny_model_dir):
    return round_trips(tiny_model_dir, TP)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_frees_the_state_and_restores_it_bitwise(trips, layout):
    assert offload_problems(trips, layout) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_after_offload_equals_update_without(trips, layout):
    assert update_problems(trips, layout) == []


def _engine_phase_switch(cfg):
    """The calls the trainer makes around a generation, on a CPU engine: accepted, and the engine unchanged."""
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(cfg.model.path, cfg.rollout, "float32", seed=0)
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


# The demo calls them between phases at every step (its mismatch shows they change nothing): `slow`.
@pytest.mark.slow
def test_engine_sleep_and_wake_up_are_accepted_and_change_nothing_on_cpu(tiny_model_dir):
    """On CPU vLLM has no sleep mode: the trainer still calls them between phases, and bad arguments still fail."""
    [(before, after, unchanged, errors, asleep)] = run_distributed(_engine_phase_switch, world_size=1,
                                                                   args=(config(tiny_model_dir, tp=1, pp=1),))
    assert before == after and all(before) and unchanged and asleep == set()
    assert "sleep(level=3): use 1" in errors[0]
    assert "['cache'] unknown" in errors[1]
