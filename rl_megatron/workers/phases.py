"""Where a worker's state lives between phases, as an explicit state machine.

A hybrid worker takes turns: the rollout engine generates, then Megatron computes (forward passes, updates) for each
role, then the new weights go into the engine. On GPU each turn wants the device memory the others hold, so:

- a role's Megatron state ("params", "grads", "optimizer") waits in host memory while others use the device
  (only for roles given an `Offloader`: the actor and critic with actor.offload, the reference and the teacher with
  ref.param_offload and teacher.param_offload);
- the engine sleeps while Megatron computes, which frees its KV cache and its weights' device memory: at level 2,
  which *discards the weights* (every sync rewrites them), or at level 1, which keeps them in host memory (an engine
  serving LoRA adapters, whose frozen base no sync after the first resends: `PhaseMachine.sleep_level`).

`PhaseMachine` knows what is where and turns "I need phase P" into the moves that get there. It is pure logic:
it returns `Move`s and the worker carries them out (offloaders, engine, resharder), so every sequence the trainer
can produce is tested on CPU as plain state transitions. Its invariant: **the engine never generates with weights
older than the policy**. An actor update or a level-2 sleep makes the engine's weights stale; entering generation
with stale weights syncs them first (a save, a critic warm-up step or a validation pass between an update and the
next generation all go through here). This is the hybrid engine's offload/sleep pattern as verl's
ActorRolloutRefWorker and its sharding manager run it on GPU (wake weights -> sync -> wake KV cache; sleep before
training).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rl_megatron.roles import Role

STATE = ("params", "grads", "optimizer")  # a role's state, in Offloader's categories


@dataclass(frozen=True)
class Phase:
    """What a dispatched method needs. kind: "generate" (the engine, with current weights), "sync" (write the
    policy's weights into the engine), "forward" (role's params on the device), "save" (role's whole state on the
    device, read), "train" (role's whole state on the device, changed by an update: a changed actor makes the
    engine's weights stale), "load" (as "train", by a checkpoint loaded: the actor's frozen base changes too)."""
    kind: str
    role: Role | None = None

    def state(self) -> tuple[str, ...]:
        return ("params",) if self.kind == "forward" else STATE

    @property
    def label(self) -> str:
        """Its name in a profiler's trace and nsys's timeline, e.g. "generate", "forward ref", "train actor"."""
        return self.kind if self.role is None else f"{self.kind} {self.role}"


GENERATE = Phase("generate")
SYNC = Phase("sync")


def forward(role: Role) -> Phase:
    return Phase("forward", role)


def train(role: Role) -> Phase:
    return Phase("train", role)


def save(role: Role) -> Phase:
    return Phase("save", role)


def load(role: Role) -> Phase:
    return Phase("load", role)


@dataclass(frozen=True)
class Move:
    """One step the worker carries out. kind: "to_host" / "to_device" (a role's `parts` of its state), "sleep" (the
    engine, at `level`: `rollout.engine.SLEEP_LEVELS`), "wake" (the engine's `parts`: `rollout.engine.WAKE_TAGS`),
    "zero_unheld" (zero the engine's parameters that no sync writes, `resharding.specs.zero_what_no_region_holds`),
    "sync" (the policy's `parts` into the engine: "weights", all that the resharder writes, the whole model or a LoRA
    policy's frozen base; "adapters", a LoRA policy's adapters, which the engine serves)."""
    kind: str
    role: Role | None = None
    parts: tuple[str, ...] = ()
    level: int | None = None


@dataclass
class PhaseMachine:
    """`offloaded`: roles whose state moves between device and host; `engine`: the worker hosts an engine;
    `engine_sleeps`: the engine frees its memory during Megatron phases (`RolloutEngine.sleeps`: vLLM on GPU);
    `adapters`: the engine serves the policy's LoRA adapters on its frozen base (actor.lora.merge=false)."""
    offloaded: tuple[Role, ...] = ()
    engine: bool = False
    engine_sleeps: bool = False
    adapters: bool = False
    on_host: dict[Role, set[str]] = field(default_factory=dict)  # the parts of each role's state in host memory
    engine_asleep: set[str] = field(default_factory=set)  # the engine's parts a sleep freed and no wake restored
    policy_version: int = 0  # actor updates (and checkpoints loaded) in this worker
    engine_version: int | None = None  # the policy version the engine's weights hold; None: none (dummy, discarded)
    engine_has_base: bool = False  # `adapters`: the engine holds the policy's frozen base

    def __post_init__(self):
        # Every offloaded role starts in host memory: the worker moves it there before the engine starts, so that
        # the engine, sizing its KV cache by the device memory free at start (vLLM), does not count Megatron's state
        # as used (verl's order); each role comes back when a phase first needs it.
        for role in self.offloaded:
            self.on_host.setdefault(role, set(STATE))

    @property
    def engine_current(self) -> bool:
        return self.engine_version == self.policy_version

    @property
    def sleep_level(self) -> int:
        """The engine's sleep level (`RolloutEngine.sleep`); both free the same device memory (weights and KV cache). Level 2
        discards the weights: right for an engine that every sync rewrites whole. An engine serving adapters gets
        its frozen base at the first sync only, then the adapters alone, so level 2 would leave it generating from
        garbage after its first sleep. Level 1 keeps its weights in host memory instead: host RAM equal to the
        engine shard's weights, no device memory, no resend. Resending the base after every level-2 sleep would
        send the whole model at every step (about 50 times the adapters' bytes in the 7B LoRA recipe), undoing
        what serving the adapters saves. verl's Megatron worker also sleeps at level 1 for unmerged LoRA."""
        return 1 if self.adapters else 2

    def enter(self, phase: Phase) -> list[Move]:
        """The moves that make `phase` possible, applied to the machine's state."""
        if phase.kind == "generate":
            moves = [] if self.engine_current else self._sync_moves()
            moves += [self._to_host(role, STATE) for role in self.offloaded]
            return self._done(moves + self._wake(("weights", "kv_cache")))
        if phase.kind == "sync":
            if not self.engine:  # the engines are elsewhere (separate placement), waiting to receive: always send
                self.engine_version = None
            return self._done(self._sync_moves())
        if phase.kind in ("forward", "save", "train", "load"):
            moves = [self._sleep()]
            if phase.role in self.offloaded:
                moves.append(self._to_device(phase.role, phase.state()))
            return self._done(moves)
        raise ValueError(f"unknown phase {phase.kind!r}")

    def leave(self, phase: Phase) -> list[Move]:
        """The moves after `phase`: a changed actor makes the engine's weights stale (a loaded one its base too);
        a frozen model (the reference, the teacher) goes back to host memory until its next use."""
        if phase in (train(Role.ACTOR), load(Role.ACTOR)):
            self.policy_version += 1
        if phase == load(Role.ACTOR):
            self.engine_has_base = False  # the checkpoint's base (a random model's is saved with it)
        if phase.role in self.offloaded and not phase.role.trainable:
            return self._done([self._to_host(phase.role, STATE)])
        return []

    def _sync_moves(self) -> list[Move]:
        """What a weight sync needs: the actor's params on the device (nothing else of Megatron's), the engine's
        weights awake (not yet its KV cache: the peak stays lower while the trainer's state leaves the device)."""
        if self.engine_current:
            return []
        moves = [self._to_host(role, ("grads", "optimizer") if role is Role.ACTOR else STATE)
                 for role in self.offloaded]
        if Role.ACTOR in self.offloaded:
            moves.append(self._to_device(Role.ACTOR, ("params",)))
        moves += self._wake(("weights",)) + [Move("sync", parts=self._sent())]
        self.engine_version = self.policy_version
        return moves

    def _sent(self) -> tuple[str, ...]:
        """What a sync sends: the policy's weights, or to an engine serving adapters, the adapters on the base it
        holds (the base first where it holds none)."""
        if not self.adapters:
            return ("weights",)
        sent = ("adapters",) if self.engine_has_base else ("weights", "adapters")
        self.engine_has_base = True
        return sent

    def _to_host(self, role: Role, parts: tuple[str, ...]) -> Move | None:
        moving = tuple(p for p in parts if p not in self.on_host[role])
        self.on_host[role] |= set(moving)
        return Move("to_host", role, moving) if moving else None

    def _to_device(self, role: Role, parts: tuple[str, ...]) -> Move | None:
        moving = tuple(p for p in parts if p in self.on_host[role])
        self.on_host[role] -= set(moving)
        return Move("to_device", role, moving) if moving else None

    def _sleep(self) -> Move | None:
        # As `RolloutEngine.sleep`: a sleep while any part is still asleep does nothing; the engine wakes fully first.
        if not (self.engine and self.engine_sleeps) or self.engine_asleep:
            return None
        self.engine_asleep = {"weights", "kv_cache"}
        if self.sleep_level == 2:
            self.engine_version = None  # the weights are discarded
        return Move("sleep", level=self.sleep_level)

    def _wake(self, parts: tuple[str, ...]) -> list[Move]:
        waking = tuple(part for part in parts if part in self.engine_asleep)
        if not waking:
            return []
        self.engine_asleep -= set(waking)
        moves = [Move("wake", parts=waking)]
        if "weights" in waking and self.sleep_level == 2:
            # Level 2 woke the weights in memory holding anything: the sync that follows writes every HF region, but
            # not the parameters holding none on this rank, zeroed only once at the engine's start (gpt-oss's expert
            # down-projection biases on MoE TP ranks >= 1: the ranks' outputs are summed, so only rank 0 adds its).
            moves.append(Move("zero_unheld"))
        return moves

    @staticmethod
    def _done(moves: list[Move | None]) -> list[Move]:
        return [move for move in moves if move is not None]
