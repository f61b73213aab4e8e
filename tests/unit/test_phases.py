"""The worker's phase machine: the moves between generation and Megatron phases, and the invariant that the engine
never generates with weights older than the policy (on GPU a level-2 sleep discards them)."""
import random

import pytest

from rl_megatron.roles import Role
from rl_megatron.workers.phases import GENERATE, SYNC, Move, Phase, PhaseMachine, forward, save, train

ACTOR, REF, CRITIC = Role.ACTOR, Role.REF, Role.CRITIC


def gpu_machine() -> PhaseMachine:
    """A GPU hybrid worker with every offload on: actor and critic state, and the reference's weights."""
    return PhaseMachine(offloaded=(ACTOR, CRITIC, REF), engine=True, engine_sleeps=True)


class Simulated:
    """An independent reading of the moves: what the engine holds and where each role's state is, as the worker
    would leave them after carrying the moves out."""

    def __init__(self, machine: PhaseMachine):
        self.machine = machine
        self.policy = 0  # the policy's true version: actor updates so far
        self.engine_weights = None  # the version the engine's weights hold (dummy at start)
        self.engine_awake = {"weights", "kv_cache"}
        self.on_device = {role: set() for role in machine.offloaded}  # offloaded before the engine starts

    def run(self, phase: Phase) -> list[Move]:
        moves = self.machine.enter(phase)
        for move in moves:
            if move.kind == "to_host":
                assert set(move.parts) <= self.on_device[move.role], move
                self.on_device[move.role] -= set(move.parts)
            elif move.kind == "to_device":
                assert not set(move.parts) & self.on_device[move.role], move
                self.on_device[move.role] |= set(move.parts)
            elif move.kind == "sleep":
                self.engine_awake, self.engine_weights = set(), None
            elif move.kind == "wake":
                self.engine_awake |= set(move.parts)
            elif move.kind == "sync":
                assert "weights" in self.engine_awake, "a sync writes into weights that are asleep"
                if ACTOR in self.on_device:
                    assert "params" in self.on_device[ACTOR], "a sync reads the actor's params from host memory"
                self.engine_weights = self.policy
        self.check(phase)
        leaving = self.machine.leave(phase)
        for move in leaving:
            assert move.kind == "to_host"
            self.on_device[move.role] -= set(move.parts)
        if phase == train(ACTOR):  # an update, or a checkpoint loaded
            self.policy += 1
        return moves + leaving

    def check(self, phase: Phase) -> None:
        if phase == GENERATE:
            assert self.engine_weights == self.policy, "the engine generates with stale weights"
            assert self.engine_awake == {"weights", "kv_cache"}
            assert all(not parts for parts in self.on_device.values()), "Megatron state holds the device"
        elif phase == SYNC:
            assert self.engine_weights == self.policy
        elif phase.role in self.on_device:
            assert set(phase.state()) <= self.on_device[phase.role]


def one_step(sim: Simulated, critic_warmup: bool = False) -> None:
    sim.run(GENERATE)
    for phase in (forward(ACTOR), forward(REF), forward(CRITIC), train(CRITIC)):
        sim.run(phase)
    if not critic_warmup:
        sim.run(train(ACTOR))
        sim.run(SYNC)


def save_checkpoint(sim: Simulated) -> None:
    """What a checkpoint save asks of a worker: each model's state on the device, in turn."""
    for role in (ACTOR, CRITIC, REF):
        sim.run(save(role))


def load_checkpoint(sim: Simulated) -> None:
    """Loading changes each model's state: for the actor, like an update."""
    for role in (ACTOR, CRITIC, REF):
        sim.run(train(role))


def test_a_step_moves_each_state_where_its_phase_needs_it():
    sim = Simulated(gpu_machine())
    # Megatron's state starts in host memory (moved there before the engine measured the free memory); the engine
    # starts awake, with dummy weights.
    assert sim.run(SYNC) == [Move("to_device", ACTOR, ("params",)), Move("sync")]
    assert sim.run(GENERATE) == [Move("to_host", ACTOR, ("params",))]
    assert sim.run(forward(ACTOR)) == [Move("sleep"), Move("to_device", ACTOR, ("params",))]
    assert sim.run(forward(REF)) == [Move("to_device", REF, ("params",)), Move("to_host", REF, ("params",))]
    assert sim.run(train(ACTOR)) == [Move("to_device", ACTOR, ("grads", "optimizer"))]
    assert sim.run(SYNC) == [Move("to_host", ACTOR, ("grads", "optimizer")), Move("wake", parts=("weights",)),
                             Move("sync")]
    assert sim.run(GENERATE) == [Move("to_host", ACTOR, ("params",)), Move("wake", parts=("kv_cache",))]


def test_generation_after_a_checkpoint_save_syncs_the_weights_the_sleep_discarded():
    # The GPU bug this machine exists for: after the step's validation had woken the engine fully, saving put it
    # to sleep at level 2, and the next generation woke it without a sync, sampling from uninitialised memory.
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    one_step(sim)
    sim.run(GENERATE)  # validation
    save_checkpoint(sim)
    moves = sim.run(GENERATE)
    assert Move("sync") in moves and moves.index(Move("sync")) < moves.index(Move("wake", parts=("kv_cache",)))


def test_generation_after_a_critic_warmup_step_syncs_first():
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    one_step(sim, critic_warmup=True)  # no actor update, no sync; the critic's phases put the engine to sleep
    assert Move("sync") in sim.run(GENERATE)


def test_an_engine_that_is_current_is_not_synced_again():
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    one_step(sim)
    assert Move("sync") not in sim.run(GENERATE)  # validation right after the step's sync
    assert Move("sync") not in sim.run(GENERATE)
    assert sim.run(SYNC) == []


def test_resume_loads_then_syncs_once():
    sim = Simulated(gpu_machine())
    load_checkpoint(sim)
    assert Move("sync") in sim.run(SYNC)
    assert Move("sync") not in sim.run(GENERATE)


def test_without_sleep_mode_only_an_update_makes_the_engine_stale():
    # CPU: vLLM has no sleep mode and nothing is offloaded; saving leaves the engine's weights as they are.
    sim = Simulated(PhaseMachine(engine=True, engine_sleeps=False))
    assert sim.run(SYNC) == [Move("sync")]
    save_checkpoint(sim)
    assert sim.run(GENERATE) == []
    sim.run(train(ACTOR))
    assert sim.run(GENERATE) == [Move("sync")]


@pytest.mark.parametrize("seed", range(20))
def test_any_sequence_of_phases_keeps_the_invariants(seed):
    """Random sequences of what the trainer can ask (steps with and without critic warm-up, saves, validation,
    syncs, in any order): `Simulated.check` asserts at every phase that the engine holds the policy's weights when
    it generates and that each role's state is where its phase needs it."""
    rng = random.Random(seed)
    offloaded = tuple(role for role in (ACTOR, CRITIC, REF) if rng.random() < 0.7)
    sim = Simulated(PhaseMachine(offloaded=offloaded, engine=True, engine_sleeps=rng.random() < 0.8))
    phases = [GENERATE, SYNC] + [kind(role) for kind in (forward, save, train) for role in (ACTOR, CRITIC)]
    phases += [forward(REF), save(REF), train(REF)] if REF in offloaded else []
    for _ in range(60):
        sim.run(rng.choice(phases))


def test_a_separate_actor_sends_without_an_engine():
    # rollout.placement=separate: the actor's worker has no engine; a sync sends the weights to the engine workers.
    # The engine workers wait to receive whenever the trainer syncs, so every sync sends.
    sim = Simulated(PhaseMachine())
    assert sim.run(SYNC) == [Move("sync")]
    assert sim.run(SYNC) == [Move("sync")]
    sim.run(train(ACTOR))
    assert sim.run(SYNC) == [Move("sync")]
