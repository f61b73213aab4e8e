"""A pool's memory per GPU phase by phase, its peak, and the keys that lower a pool over the GPU's memory.

On GPU, with actor.offload, the workers that host the engine (the actor's pool with rollout colocated) take turns:
the engine and Megatron's state are never on the device together (`workers/phases.py`'s PhaseMachine; verl's hybrid
engine with parameter and optimizer offload). Each phase holds:
  training     the actor's and a colocated critic's training states (the critic's stays through the actor's
               update: the machine sends it to host memory only at the next sync), the reference's weights when
               ref.param_offload=false, and the largest of the pool's activations. The engine sleeps at level 2
               (weights and KV cache freed; level 1 when it serves LoRA adapters: the same device memory freed, its
               weights kept in host memory), but its CUDA graphs stay: vLLM captures them outside the memory pool its
               sleep frees (`rollout/vllm_engine.py` leaves sleep_mode_offload_cudagraph off). With
               ref.param_offload the reference's weights come in for its own forward pass alone, when only the
               actor's weights are there: less than this phase counts (the actor's fp32 gradients alone take as much
               as the reference's weights).
  generation   the engine's share (rollout.gpu_memory_utilization x the GPU: weights, KV cache and CUDA graphs); all
               of Megatron's state in host memory, but the reference's weights with ref.param_offload=false.
  weight sync  the actor's weights (its gradients and Adam state in host memory, the critic's state too), the engine's
               weights woken (its KV cache not yet), its CUDA graphs, resharding.bucket_mb of buckets, and the
               reference's weights with ref.param_offload=false.
  teacher forward, reward_model forward  (a colocated teacher or reward model with <role>.param_offload) its
               weights brought in for its pass beside the actor's weights (the old log-probs' pass brought them before
               it), its activations and the engine's CUDA graphs: a model of its own, larger than the policy as a
               rule, so unlike the reference's pass it can be the peak.
A frozen role's weights with <role>.param_offload=false (ref, teacher, reward_model) stay on the device in every
phase.
A pool's peak is its largest phase. Without actor.offload the state stays on the device beside the engine, and vLLM
starts only with its share free beside it: the pool needs the sum of all it holds ("all at once"), as it does on CPU
(nothing moves, the engine never sleeps) and in pools without an engine (separate placement).
"""
from __future__ import annotations

from rl_megatron.config.schema import Config
from rl_megatron.planning.memory import GIB, gib_text
from rl_megatron.planning.pool import Held, PhaseMemory, Pool, RolePlan, peak
from rl_megatron.roles import FROZEN_ROLES, Role

# What stays of a sleeping engine: its CUDA graphs. vLLM measures them at start (it logs "Estimated CUDA graph memory:
# X GiB") and the plan cannot compute them; vLLM's issues report from 0.2 GiB (a 1B model) to 1.4 GiB (a 1T-parameter
# MoE at TP=8) per GPU. The plan allows 1.5 GiB, and never more than the engine's share leaves beside its weights
# (vLLM fits the graphs in that share).
SLEEPING_ENGINE_BYTES = int(1.5 * GIB)

TRAINING, GENERATION, WEIGHT_SYNC, ALL_AT_ONCE = "training", "generation", "weight sync", "all at once"


def hosts_engine_and_actor(pool: Pool) -> bool:
    """The hybrid engine: the actor's pool with the engines colocated (a separate engines' pool has no Megatron)."""
    return {Role.ACTOR, Role.ROLLOUT} <= {role.name for role in pool.roles}


def takes_turns(pool: Pool, cfg: Config, on_gpu: bool) -> bool:
    """Whether the pool's engine and Megatron state take turns on the device (module docstring)."""
    return on_gpu and cfg.actor.offload and hosts_engine_and_actor(pool)


def pool_phases(pool: Pool, cfg: Config, on_gpu: bool) -> list[PhaseMemory]:
    """What each GPU of `pool` holds in each of its phases (one phase, "all at once", where nothing takes turns)."""
    if not takes_turns(pool, cfg, on_gpu):
        return [PhaseMemory(ALL_AT_ONCE, tuple(Held(str(role.name), role.memory_bytes) for role in pool.roles)
                            + _activations(pool.roles))]
    roles = {role.name: role for role in pool.roles}
    engine = roles[Role.ROLLOUT]
    graphs = Held("CUDA graphs", min(SLEEPING_ENGINE_BYTES, max(engine.memory_bytes - engine.weight_bytes, 0)),
                  "of the sleeping engine")
    kept = _resident(roles, cfg)
    resident = tuple(Held(str(name), roles[name].memory_bytes, f"weights, {name}.param_offload=false") for name in kept)
    # A model of its own comes in for its pass: a phase of its own (module docstring).
    visiting = [roles[name] for name in FROZEN_ROLES if name in roles and name.own_model and name not in kept]
    trained = tuple(Held(str(role.name), role.memory_bytes) for role in pool.roles if role.name.trainable)
    in_training = [role for role in pool.roles if role not in visiting]
    return [PhaseMemory(TRAINING, trained + resident + _activations(in_training) + (graphs,)),
            PhaseMemory(GENERATION, (Held("rollout", engine.memory_bytes),) + resident),
            PhaseMemory(WEIGHT_SYNC, (Held("actor weights", roles[Role.ACTOR].weight_bytes),
                                      Held("engine weights", engine.weight_bytes),
                                      Held("buckets", cfg.resharding.bucket_mb << 20, "resharding.bucket_mb"),
                                      graphs) + resident),
            *(PhaseMemory(f"{role.name} forward", (
                Held("actor weights", roles[Role.ACTOR].weight_bytes),
                Held(str(role.name), role.memory_bytes, f"weights brought in for its pass, {role.name}.param_offload"))
              + resident + _activations([role]) + (graphs,)) for role in visiting)]


def _resident(roles: dict, cfg: Config) -> list[Role]:
    """The frozen roles of a pool whose weights stay on the device (<role>.param_offload=false)."""
    return [name for name in FROZEN_ROLES if name in roles and not getattr(cfg, str(name)).param_offload]


def _activations(roles: list[RolePlan]) -> tuple[Held, ...]:
    """The largest of these roles' activations: a pool's roles run their passes one at a time."""
    largest = max(roles, key=lambda role: role.activation_bytes)
    if not largest.activation_bytes:
        return ()
    return (Held("activations", largest.activation_bytes,
                 f"the {largest.name}'s {largest.activations.larger_pass} pass"),)


def compute_phase(phases: list[PhaseMemory]) -> PhaseMemory:
    """The phase in which a pool's Megatron passes run: training where phases take turns, else the only one."""
    return next(phase for phase in phases if phase.name in (TRAINING, ALL_AT_ONCE))


def phase_line(pool: Pool, on_gpu: bool) -> str:
    """The pool's phases in one line, their parts in GiB and the peak marked; for an engine that does not take turns,
    why; "" for the other pools (nothing moves between phases)."""
    phases = pool.phases
    if len(phases) == 1:
        return ("all at once (actor.offload=false: Megatron's state stays beside the engine's share)"
                if on_gpu and hosts_engine_and_actor(pool) else "")
    top = peak(phases)
    return "one at a time (actor.offload): " + " | ".join(
        f"{phase.name} {gib_text(phase.bytes)}{', the peak' if phase is top else ''} ("
        + " + ".join(f"{item.what} {item.bytes / GIB:.1f}" for item in phase.held) + ")" for phase in phases)


def over_memory(pool: Pool, cfg: Config, gib: float, source: str) -> str:
    """What a pool over the GPU's memory needs in its peak phase, and the keys that lower every phase over it (with
    their values now)."""
    limit = gib * GIB
    top = peak(pool.phases)
    parts = " + ".join(f"{item.what} {gib_text(item.bytes)}" + (f", {item.detail}" if item.detail else "")
                       for item in top.held)
    where = "" if top.name == ALL_AT_ONCE else f" in {top.name}"
    others = [phase for phase in pool.phases if phase is not top and phase.bytes > limit]
    also = f"; {' and '.join(f'{phase.name} ~{gib_text(phase.bytes)}' for phase in others)} too" if others else ""
    fixes: dict[str, str] = {}  # by the keys a fix names (its text before the reason): the peak's reason first
    for phase in [top, *others]:
        for fix in _phase_fixes(phase, pool, cfg):
            fixes.setdefault(fix.split(" (")[0], fix)
    return (f"the {pool.name} pool needs ~{gib_text(top.bytes)} per GPU{where} ({parts}){also}, more than the GPU's "
            f"{gib:g} GiB ({source}). Change: " + "; ".join(fixes.values()) + f"; or add nodes ({pool.nodes_key}).")


def _phase_fixes(phase: PhaseMemory, pool: Pool, cfg: Config) -> list[str]:
    """The keys that lower `phase` of `pool`, with their values now."""
    held = {item.what for item in phase.held}
    whose = {Role.REF: "the reference's", Role.TEACHER: "the teacher's", Role.REWARD_MODEL: "the reward model's"}
    ref_weights = [f"{name}.param_offload=false to true ({whose[name]} weights in host memory between its uses)"
                   for name in FROZEN_ROLES if phase.name != ALL_AT_ONCE and str(name) in held
                   and not getattr(cfg, str(name)).param_offload]
    visiting = next((name for name in FROZEN_ROLES if phase.name == f"{name} forward"), None)
    if visiting is not None:  # a frozen model of its own brought in beside the actor's weights
        return _memory_fixes(visiting, cfg, separate=False) + [
            f"{visiting}.placement=colocated to separate (its own GPUs)"] + ref_weights
    if phase.name == GENERATION:
        return _memory_fixes(Role.ROLLOUT, cfg, separate=False) + ref_weights
    if phase.name == WEIGHT_SYNC:
        a, r = cfg.actor, cfg.rollout
        return [f"resharding.bucket_mb={cfg.resharding.bucket_mb} lower",
                f"rollout.tensor_parallel_size={r.tensor_parallel_size} higher (the engine's weights over more GPUs)",
                f"actor.tensor_model_parallel_size={a.tensor_model_parallel_size} / actor.pipeline_model_parallel_size="
                f"{a.pipeline_model_parallel_size} higher (the actor's weights over more GPUs)"] + ref_weights
    fixes = []
    for role in pool.roles:
        if phase.name == ALL_AT_ONCE or role.name.has_model:  # in training the engine sleeps: its share is not there
            fixes += _memory_fixes(role.name, cfg, separate=pool.name == role.name and role.name is not Role.ACTOR)
    if phase.name == ALL_AT_ONCE and not cfg.actor.offload and hosts_engine_and_actor(pool):
        fixes.append("actor.offload=false to true (Megatron's state in host memory while the engine generates, the "
                     "engine asleep while Megatron computes: the pool then needs its largest phase, not the sum)")
    return fixes + ref_weights


def _yaml(value) -> str:
    """A value as the config spells it (null, true, false)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _memory_fixes(name: Role, cfg: Config, separate: bool) -> list[str]:
    """The keys that lower a role's memory per GPU, each with its value now and which way to turn it (keys already
    at their most frugal setting are left out)."""
    if name is Role.ROLLOUT:
        return [f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} lower (a smaller KV cache)"]
    section = getattr(cfg, str(name))
    budget = section.max_tokens_per_micro_batch
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    fixes = [f"{name}.max_tokens_per_micro_batch={budget} lower" if budget else
             f"{name}.max_tokens_per_micro_batch=null to a token budget (micro-batches are now "
             f"{name}.micro_batch_size={section.micro_batch_size} samples of up to {longest} tokens)"]
    if name.trainable:
        granularity, method, layers = (section.recompute_granularity, section.recompute_method,
                                       section.recompute_num_layers)
        if granularity != "full":
            fixes.append(f"{name}.recompute_granularity={_yaml(granularity)} to full with "
                         f"{name}.recompute_method=uniform {name}.recompute_num_layers=1 (each layer keeps only its "
                         "input)")
        elif method == "block" or (layers or 1) > 1:
            fixes.append(f"{name}.recompute_method={_yaml(method)} / {name}.recompute_num_layers={_yaml(layers)} to "
                         "uniform / 1 (every layer recomputed, one at a time)")
    if name is Role.ACTOR or separate:  # a colocated role runs at the actor's layout
        fixes.append(f"{name}.tensor_model_parallel_size={section.tensor_model_parallel_size} / "
                     f"{name}.pipeline_model_parallel_size={section.pipeline_model_parallel_size} higher (smaller "
                     "shards; PP shrinks the state, not the first stage's activations)")
    if name is Role.ACTOR:
        a = cfg.actor
        packing = "" if a.sequence_packing else " with actor.sequence_packing=true"
        fixes.append(f"actor.context_parallel_size={a.context_parallel_size} higher{packing} (each sequence split "
                     "over more GPUs)")
        if a.sequence_parallel is False and a.tensor_model_parallel_size > 1:
            fixes.append("actor.sequence_parallel=false to true (activations outside the TP regions split over the "
                         "TP ranks)")
    return fixes
