"""The worker's phase machine: the moves between generation and Megatron phases, and the invariant that the engine
never generates with weights older than the policy (on GPU a level-2 sleep discards them, and leaves the parameters
no sync writes holding garbage; an engine serving LoRA adapters sleeps at level 1, keeping the base no later sync
sends)."""
import random

import pytest

from rl_megatron.roles import Role
from rl_megatron.workers.phases import GENERATE, SYNC, Move, Phase, PhaseMachine, forward, load, save, train

ACTOR, REF, CRITIC, TEACHER = Role.ACTOR, Role.REF, Role.CRITIC, Role.TEACHER
SEND_WEIGHTS = Move("sync", parts=("weights",))  # the whole model
SEND_BASE_AND_ADAPTERS = Move("sync", parts=("weights", "adapters"))  # a LoRA policy's frozen base, its adapters
SEND_ADAPTERS = Move("sync", parts=("adapters",))
ZERO_UNHELD = Move("zero_unheld")


def gpu_machine() -> PhaseMachine:
    """A GPU hybrid worker with every offload on: actor and critic state, and the reference's weights."""
    return PhaseMachine(offloaded=(ACTOR, CRITIC, REF), engine=True, engine_sleeps=True)


def lora_machine() -> PhaseMachine:
    """A GPU hybrid worker whose engine serves the policy's LoRA adapters (no reference model: the actor with its
    adapters off is the reference)."""
    return PhaseMachine(offloaded=(ACTOR, CRITIC), engine=True, engine_sleeps=True, adapters=True)


class Simulated:
    """An independent reading of the moves: what the engine holds and where each role's state is, as the worker
    would leave them after carrying the moves out."""

    def __init__(self, machine: PhaseMachine):
        self.machine = machine
        self.policy = 0  # the policy's true version: actor updates and loads so far
        self.base = 0  # the version of a LoRA policy's frozen base: checkpoints loaded so far
        self.engine_weights = None  # the version the engine's weights (full model, or LoRA base) hold; None: dummy
        self.engine_adapters = None  # the policy version of the adapters the engine serves
        self.engine_awake = {"weights", "kv_cache"}
        self.unheld_zero = True  # the parameters no sync writes are zero (the engine zeroes them at start)
        self.sent = []  # the parts of each sync
        self.moves = []  # every move so far, leaving moves included
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
                assert move.level in (1, 2)
                self.engine_awake = set()
                if move.level == 2:  # vLLM discards the weights (level 1 keeps them in host memory)
                    self.engine_weights = self.engine_adapters = None
                    self.unheld_zero = False
            elif move.kind == "wake":
                self.engine_awake |= set(move.parts)
            elif move.kind == "zero_unheld":
                assert "weights" in self.engine_awake, "zeroing weights that are asleep"
                self.unheld_zero = True
            elif move.kind == "sync":
                assert "weights" in self.engine_awake, "a sync writes into weights that are asleep"
                if ACTOR in self.on_device:
                    assert "params" in self.on_device[ACTOR], "a sync reads the actor's params from host memory"
                self.sync(move.parts)
        self.check(phase)
        leaving = self.machine.leave(phase)
        for move in leaving:
            assert move.kind == "to_host"
            self.on_device[move.role] -= set(move.parts)
        if phase in (train(ACTOR), load(ACTOR)):
            self.policy += 1
        if phase == load(ACTOR):
            self.base += 1
        self.moves += moves + leaving
        return moves + leaving

    def sync(self, parts: tuple[str, ...]) -> None:
        self.sent.append(parts)
        if not self.machine.adapters:
            assert parts == ("weights",)
            self.engine_weights = self.policy
            return
        assert "adapters" in parts, "the engine serves the adapters: every sync sends them"
        if "weights" in parts:
            self.engine_weights = self.base
        assert self.engine_weights == self.base, "adapters sent onto a base the engine does not hold"
        self.engine_adapters = self.policy

    def current(self) -> bool:
        if self.machine.adapters:
            return self.engine_weights == self.base and self.engine_adapters == self.policy
        return self.engine_weights == self.policy

    def check(self, phase: Phase) -> None:
        if phase == GENERATE:
            assert self.current(), "the engine generates with stale weights"
            assert self.unheld_zero, "the engine generates with garbage where no sync writes"
            assert self.engine_awake == {"weights", "kv_cache"}
            assert all(not parts for parts in self.on_device.values()), "Megatron state holds the device"
        elif phase == SYNC:
            assert self.current()
        elif phase.role in self.on_device:
            assert set(phase.state()) <= self.on_device[phase.role]


def engine_moves(moves: list[Move]) -> list[Move]:
    return [move for move in moves if move.kind not in ("to_host", "to_device")]


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
    """Loading changes each model's state: for the actor, like an update, and its frozen base too."""
    for role in (ACTOR, CRITIC, REF):
        sim.run(load(role))


def test_a_step_moves_each_state_where_its_phase_needs_it():
    sim = Simulated(gpu_machine())
    # Megatron's state starts in host memory (moved there before the engine measured the free memory); the engine
    # starts awake, with dummy weights.
    assert sim.run(SYNC) == [Move("to_device", ACTOR, ("params",)), SEND_WEIGHTS]
    assert sim.run(GENERATE) == [Move("to_host", ACTOR, ("params",))]
    assert sim.run(forward(ACTOR)) == [Move("sleep", level=2), Move("to_device", ACTOR, ("params",))]
    assert sim.run(forward(REF)) == [Move("to_device", REF, ("params",)), Move("to_host", REF, ("params",))]
    assert sim.run(train(ACTOR)) == [Move("to_device", ACTOR, ("grads", "optimizer"))]
    assert sim.run(SYNC) == [Move("to_host", ACTOR, ("grads", "optimizer")), Move("wake", parts=("weights",)),
                             ZERO_UNHELD, SEND_WEIGHTS]
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
    assert SEND_WEIGHTS in moves and moves.index(SEND_WEIGHTS) < moves.index(Move("wake", parts=("kv_cache",)))


def test_generation_after_a_critic_warmup_step_syncs_first():
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    one_step(sim, critic_warmup=True)  # no actor update, no sync; the critic's phases put the engine to sleep
    assert SEND_WEIGHTS in sim.run(GENERATE)


def test_an_engine_that_is_current_is_not_synced_again():
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    one_step(sim)
    assert SEND_WEIGHTS not in sim.run(GENERATE)  # validation right after the step's sync
    assert SEND_WEIGHTS not in sim.run(GENERATE)
    assert sim.run(SYNC) == []


def test_resume_loads_then_syncs_once():
    sim = Simulated(gpu_machine())
    load_checkpoint(sim)
    assert SEND_WEIGHTS in sim.run(SYNC)
    assert SEND_WEIGHTS not in sim.run(GENERATE)


def test_without_sleep_mode_only_an_update_makes_the_engine_stale():
    # CPU: vLLM has no sleep mode and nothing is offloaded; saving leaves the engine's weights as they are.
    sim = Simulated(PhaseMachine(engine=True, engine_sleeps=False))
    assert sim.run(SYNC) == [SEND_WEIGHTS]
    save_checkpoint(sim)
    assert sim.run(GENERATE) == []
    sim.run(train(ACTOR))
    assert sim.run(GENERATE) == [SEND_WEIGHTS]


@pytest.mark.parametrize("seed", range(20))
def test_any_sequence_of_phases_keeps_the_invariants(seed):
    """Random sequences of what the trainer can ask (steps with and without critic warm-up, saves, loads,
    validation, syncs, in any order), with full weights or LoRA adapters in the engine: `Simulated.check` asserts at
    every phase that the engine holds the policy's weights (its base and adapters) when it generates, with zeros
    where no sync writes, and that each role's state is where its phase needs it."""
    rng = random.Random(seed)
    adapters = rng.random() < 0.5  # LoRA served by the engine: no reference model
    offloaded = tuple(role for role in (ACTOR, CRITIC, REF, TEACHER, Role.REWARD_MODEL)
                      if rng.random() < 0.7 and not (adapters and role is REF))
    sim = Simulated(PhaseMachine(offloaded=offloaded, engine=True, engine_sleeps=rng.random() < 0.8,
                                 adapters=adapters))
    phases = [GENERATE, SYNC] + [kind(role) for kind in (forward, save, train, load) for role in (ACTOR, CRITIC)]
    phases += [forward(REF), save(REF), train(REF), load(REF)] if REF in offloaded else []
    # A teacher and a reward model are neither trained nor saved.
    phases += [forward(role) for role in (TEACHER, Role.REWARD_MODEL) if role in offloaded]
    for _ in range(60):
        sim.run(rng.choice(phases))


def test_the_teachers_weights_visit_the_device_for_its_pass_only():
    # teacher.param_offload, beside a LoRA policy whose engine serves the adapters: the teacher's weights come in for
    # its pass and leave after it, as the reference's do, and touch neither the engine nor the actor's state.
    sim = Simulated(PhaseMachine(offloaded=(ACTOR, TEACHER), engine=True, engine_sleeps=True, adapters=True))
    sim.run(SYNC)
    sim.run(GENERATE)
    sim.run(forward(ACTOR))
    assert sim.run(forward(TEACHER)) == [Move("to_device", TEACHER, ("params",)),
                                         Move("to_host", TEACHER, ("params",))]
    assert sim.run(train(ACTOR)) == [Move("to_device", ACTOR, ("grads", "optimizer"))]
    assert SEND_ADAPTERS in sim.run(GENERATE)


def test_a_separate_actor_sends_without_an_engine():
    # rollout.placement=separate: the actor's worker has no engine; a sync sends the weights to the engine workers.
    # The engine workers wait to receive whenever the trainer syncs, so every sync sends.
    sim = Simulated(PhaseMachine())
    assert sim.run(SYNC) == [SEND_WEIGHTS]
    assert sim.run(SYNC) == [SEND_WEIGHTS]
    sim.run(train(ACTOR))
    assert sim.run(SYNC) == [SEND_WEIGHTS]


def test_an_engine_serving_adapters_sleeps_at_level_1_and_then_gets_the_adapters_alone():
    # The GPU bug: the engine slept at level 2, discarding the frozen base with the rest, and the next sync sent the
    # adapters alone, onto garbage. At level 1 the base waits in host memory and comes back with the weights' wake.
    sim = Simulated(lora_machine())
    assert sim.run(SYNC) == [Move("to_device", ACTOR, ("params",)), SEND_BASE_AND_ADAPTERS]
    assert sim.run(GENERATE) == [Move("to_host", ACTOR, ("params",))]
    assert sim.run(forward(ACTOR)) == [Move("sleep", level=1), Move("to_device", ACTOR, ("params",))]
    assert sim.run(train(ACTOR)) == [Move("to_device", ACTOR, ("grads", "optimizer"))]
    assert sim.run(SYNC) == [Move("to_host", ACTOR, ("grads", "optimizer")), Move("wake", parts=("weights",)),
                             SEND_ADAPTERS]
    assert sim.run(GENERATE) == [Move("to_host", ACTOR, ("params",)), Move("wake", parts=("kv_cache",))]
    one_step(sim)
    sim.run(GENERATE)  # validation
    save_checkpoint(sim)  # a sleep without an update: the engine's weights come back as they were, unsynced
    assert engine_moves(sim.run(GENERATE)) == [Move("wake", parts=("weights", "kv_cache"))]
    one_step(sim, critic_warmup=True)
    assert engine_moves(sim.run(GENERATE)) == [Move("wake", parts=("weights", "kv_cache"))]
    assert {move.level for move in sim.moves if move.kind == "sleep"} == {1}
    assert sim.sent == [("weights", "adapters"), ("adapters",), ("adapters",)]


def test_an_engine_serving_adapters_gets_the_base_again_after_a_checkpoint_is_loaded():
    sim = Simulated(lora_machine())
    sim.run(SYNC)
    one_step(sim)
    load_checkpoint(sim)
    assert SEND_BASE_AND_ADAPTERS in sim.run(GENERATE)
    one_step(sim)
    assert sim.sent == [("weights", "adapters"), ("adapters",), ("weights", "adapters"), ("adapters",)]


def test_full_weight_engines_sleep_at_level_2_and_zero_what_no_sync_writes_after_each_wake():
    # gpt-oss at engine TP >= 2: the expert down-projection biases of MoE TP ranks >= 1 hold no HF region, so no
    # sync writes them; zeroed at the engine's start only, a level-2 wake would give them whatever memory holds.
    sim = Simulated(gpu_machine())
    sim.run(SYNC)
    for _ in range(3):
        one_step(sim)
        sim.run(GENERATE)  # validation
        save_checkpoint(sim)
        for phase in (GENERATE, forward(ACTOR), forward(CRITIC), GENERATE):
            sim.run(phase)
    moves = engine_moves(sim.moves)
    sleeps = [move for move in moves if move.kind == "sleep"]
    weight_wakes = [i for i, move in enumerate(moves) if move.kind == "wake" and "weights" in move.parts]
    assert sleeps and all(move.level == 2 for move in sleeps)
    assert len(weight_wakes) == moves.count(ZERO_UNHELD) == len(sleeps)
    assert all(moves[i + 1] == ZERO_UNHELD and moves[i + 2] == SEND_WEIGHTS for i in weight_wakes)
