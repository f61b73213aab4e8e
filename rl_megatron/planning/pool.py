"""A pool of the plan, as `plan.py` fills it in: its nodes, the roles it hosts (one `RolePlan` each) and what each of
its GPUs holds phase by phase (`PhaseMemory`s, which `phase_memory.py` works out from its roles)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_megatron.planning.memory import Activations


@dataclass(frozen=True)
class Held:
    """One thing a phase keeps on each GPU of its pool."""
    what: str
    bytes: int
    detail: str = ""  # for the over-memory message: e.g. whose activations, which pass


@dataclass(frozen=True)
class PhaseMemory:
    name: str  # training, generation, weight sync; "all at once" where nothing takes turns
    held: tuple[Held, ...]

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.held)


def peak(phases: list[PhaseMemory]) -> PhaseMemory:
    """The phase that needs the most (the first of equals, in phase order)."""
    return max(phases, key=lambda phase: phase.bytes)


@dataclass
class RolePlan:
    """One role's line of the plan."""
    name: str
    engine: str  # Megatron (trained), Megatron forward-only, or vLLM
    layout: str  # its parallel sizes, printed
    memory_bytes: int  # per GPU: weights (+ gradients and optimizer state), or the engine's share
    memory_note: str
    weight_bytes: int  # per GPU: its weights alone (what a weight sync holds of the actor and of the engine)
    activations: Optional[Activations] = None  # a Megatron role's passes (None for the engines)
    activation_note: str = ""

    @property
    def activation_bytes(self) -> int:
        return self.activations.bytes if self.activations else 0


@dataclass
class Pool:
    name: str
    first_node: int
    nnodes: int
    gpus_per_node: int
    nodes_key: str  # config keys of its size, for messages
    gpus_key: str
    roles: list[RolePlan] = field(default_factory=list)
    placement_notes: list[str] = field(default_factory=list)
    phases: list[PhaseMemory] = field(default_factory=list)  # what it holds phase by phase, once its roles are in

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def activation_bytes(self) -> int:
        """The largest of its roles' activations: the roles of a pool run their passes one at a time."""
        return max((role.activation_bytes for role in self.roles), default=0)

    @property
    def peak(self) -> PhaseMemory:
        return peak(self.phases)

    @property
    def memory_bytes(self) -> int:
        """Per GPU at its peak phase (the sum of all it holds where nothing takes turns)."""
        return self.peak.bytes
