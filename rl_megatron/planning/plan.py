"""Which roles run on which nodes, with which parallel layout, and how much memory each GPU needs.

Placement rule. Megatron numbers ranks TP fastest, then CP, then DP (EP inside it for experts), then PP
(parallel_state's default order "tp-cp-ep-dp-pp"), and a pool's ranks are packed by node in node order (node k
of a pool holds its ranks k*G .. k*G+G-1, G GPUs per node). So:
- a TP group (TP consecutive ranks) stays on one node iff TP <= G and G % TP == 0: TP all-reduces run in
  every layer and must stay on NVLink;
- PP stage s holds the consecutive ranks s*W/PP .. (s+1)*W/PP - 1, so stages follow node order; each stage
  either spans whole nodes (W/PP a multiple of G) or fits inside one (W/PP divides G), never half of a node
  shared with its neighbour;
- a vLLM engine (rollout TP consecutive ranks) stays on one node by the same rule as TP, or, for weights that one
  node cannot hold (DeepSeek-V3 in bf16: 1.3 TB), spans whole nodes (TP a multiple of G): vLLM's SPMD engine takes
  its TP group from the trainer's ranks wherever they are, and its all-reduces then cross the network;
- an EP group (ETP*EP consecutive ranks of the experts' own rank order, ETP = expert-TP, default TP) may span
  nodes: its all-to-all then crosses the network.
Pools (`config.pools.worker_pools`, which the trainer starts its workers from too): the actor's (trainer.nnodes x
trainer.n_gpus_per_node) holds actor + rollout and the colocated reference / critic; a role with
placement=separate gets its own nodes after it (engines first, then ref, then critic).
Memory per GPU (`memory.py`'s formulas): each role's weights (and training state) or engine share, and the largest
of the pool's activations, held phase by phase (`phase_memory.py`): with actor.offload the engine and Megatron's
state take turns on the GPU, so the pool needs its largest phase (training, generation or weight sync); without it,
or in a pool without the engine, the sum. A pool whose peak is over the GPU's memory is refused where that memory is
known (nvidia-smi on the launching node, GPU_MEMORY_GIB), naming the keys that lower it, and a warning over the 80
GiB assumed otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from rl_megatron.config import ConfigError
from rl_megatron.config.choices import lora_modules
from rl_megatron.config.pools import worker_pools
from rl_megatron.config.schema import Config
from rl_megatron.models.activations import sequence_parallel_on
from rl_megatron.models.family import needs_sequence_parallel
from rl_megatron.models.hf_config import carries_routing, model_config, read_hf_config, role_model_config
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers, stage_runs
from rl_megatron.planning import memory
from rl_megatron.planning.lora_memory import lora_parameters
from rl_megatron.planning.engine_cache import sample_cache
from rl_megatron.planning.memory import gib_text
from rl_megatron.planning.phase_memory import SLEEPING_ENGINE_BYTES, over_memory, phase_line, pool_phases
from rl_megatron.planning.pool import Pool, RolePlan
from rl_megatron.rewards.judge import JUDGE_PATH_KEY, judge_engine_settings
from rl_megatron.roles import Role
from rl_megatron.rollout.engine import lora_merge_reason

DEFAULT_GPU_MEMORY_GIB = 80.0  # an H100 80GB; GPU_MEMORY_GIB or nvidia-smi give the real size


@dataclass
class ClusterPlan:
    pools: list[Pool]
    gpu_memory_gib: float
    gpu_memory_source: str
    gpu_memory_known: bool  # measured or given (GPU_MEMORY_GIB), not assumed: a plan over it is refused
    on_gpu: bool
    total_parameters: int
    dtype: str
    warnings: list[str] = field(default_factory=list)

    @property
    def nnodes(self) -> int:
        return sum(pool.nnodes for pool in self.pools)

    @property
    def gpus_per_node(self) -> int:
        return max(pool.gpus_per_node for pool in self.pools)

    @property
    def total_gpus(self) -> int:
        return sum(pool.world for pool in self.pools)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _nodes(first: int, count: int) -> str:
    return f"node {first}" if count == 1 else f"nodes {first}-{first + count - 1}"


def _check_within_node(size: int, size_key: str, pool: Pool, what: str) -> str:
    """A group of `size` consecutive ranks must sit on one node of `pool`."""
    g = pool.gpus_per_node
    if size > g or g % size:
        divisors = [d for d in range(1, g + 1) if g % d == 0]
        raise ConfigError(f"{size_key}={size} does not fit the {pool.name} pool's {pool.gpus_key}={g} GPUs per node: "
                          f"a {what} would {'cross nodes' if size > g else 'straddle two nodes'} ({what}s must stay "
                          f"on one node's NVLink). Use a {size_key} that divides {g} "
                          f"({', '.join(map(str, divisors))}), or change {pool.gpus_key}.")
    return f"each {what} ({size} GPUs) inside one node"


def _check_engine(size: int, pool: Pool, key: str) -> str:
    """A vLLM engine's `size` consecutive ranks (`key`): inside one node (as a TP group), or over whole nodes."""
    g = pool.gpus_per_node
    if size > g and size % g == 0:
        return (f"each vLLM engine ({size} GPUs) spans {size // g} whole nodes: its all-reduces cross the network "
                "(for weights one node cannot hold)")
    if size > g:
        raise ConfigError(f"{key}={size} does not fit the {pool.name} pool's "
                          f"{pool.gpus_key}={g} GPUs per node: an engine would share a node with the next one. Use a "
                          f"divisor of {g} (one node's NVLink), or a multiple of {g} (whole nodes, for weights one "
                          "node cannot hold).")
    return _check_within_node(size, key, pool, "vLLM engine")


def _check_stages(pp: int, pp_key: str, pool: Pool) -> str:
    """Pipeline stages are consecutive rank ranges: whole nodes each, or several stages within one node."""
    per_stage, g = pool.world // pp, pool.gpus_per_node
    if per_stage % g == 0:
        return f"PP stage = {per_stage} GPUs = {per_stage // g} node(s), stages in node order"
    if g % per_stage == 0:
        return f"PP stage = {per_stage} GPUs, {g // per_stage} stages per node, in node order"
    fitting = [p for p in range(1, pool.world + 1)
               if pool.world % p == 0 and ((pool.world // p) % g == 0 or g % (pool.world // p) == 0)]
    raise ConfigError(f"{pp_key}={pp} gives pipeline stages of {pool.world} / {pp} = {per_stage} GPUs, which neither "
                      f"fill whole nodes nor fit in one ({pool.gpus_key}={g}): two stages would share a node split "
                      f"unevenly. Choose {pp_key} among {', '.join(map(str, fitting))} (with TP x CP dividing the "
                      f"rest), or change {pool.nodes_key} / {pool.gpus_key}.")


def _megatron_role(name: Role, pool: Pool, layout: dict, hf: dict, cfg: Config, on_gpu: bool) -> RolePlan:
    """A Megatron role in `pool` (`layout`: the pool's TP, PP and, for the actor's pool, VPP, CP, EP, expert-TP): its
    placement checked, its layout and per-GPU memory worked out."""
    tp, pp = layout["tp"], layout["pp"]
    vpp, cp, ep, etp = layout.get("vpp", 1), layout.get("cp", 1), layout.get("ep", 1), layout.get("etp", tp)
    trained, value_head = name.trainable, name.value_head
    notes = [_check_within_node(tp, f"{name}.tensor_model_parallel_size", pool, "TP group"),
             _check_stages(pp, f"{name}.pipeline_model_parallel_size", pool)]
    dp = pool.world // (tp * pp * cp)
    if cp > 1:  # rank order tp-cp-...: one sequence's ranks are TP x CP consecutive ones, exchanging K/V every layer
        span = tp * cp
        where = "inside one node" if span <= pool.gpus_per_node else f"across {span // pool.gpus_per_node} nodes"
        notes.append(f"TP x CP group ({span} GPUs share a sequence) {where}")
    if ep > 1:
        span = etp * ep
        where = "inside one node" if span <= pool.gpus_per_node else f"across {span // pool.gpus_per_node} nodes"
        notes.append(f"EP group ({span} GPUs incl. expert-TP) {where}")
    if name is Role.ACTOR or pool.name == name:  # a colocated role shares the actor's groups: nothing new to say
        pool.placement_notes.append(f"{name}: " + "; ".join(notes))
    stages = StageLayers.of_role(cfg, name)
    params = memory.rank_parameters(hf, tp, pp, ep, cfg.model.make_vocab_size_divisible_by, value_head, etp, vpp,
                                    stages, transformer_engine=on_gpu)
    dtype, lora = cfg.model.dtype, cfg.actor.lora
    if name is Role.ACTOR and lora.rank:
        modules = lora_modules(lora.target_modules)
        adapters, merged = lora_parameters(hf, modules, lora.rank, tp, pp, vpp, stages, transformer_engine=on_gpu)
        trained_state = memory.training_state_bytes(memory.RankParameters(dense=adapters, expert=0), dtype, dp, ep,
                                                    cp, distributed_optimizer=on_gpu, tp=tp, etp=etp)
        reason = lora_merge_reason(cfg)
        if reason:
            sync = f"{_count(merged)} merged for the weight sync ({reason})"
        else:  # the engines load the whole adapter, gathered on each rank
            merged = 0
            whole = memory.weight_bytes(lora_parameters(hf, modules, lora.rank, transformer_engine=on_gpu)[0], dtype)
            sync = f"weight sync: the base once, then only the adapters, {memory.gib_text(whole)} (vLLM LoRA)"
        weights = memory.weight_bytes(params.total + merged, dtype)
        bytes_ = weights + trained_state
        note = (f"{_count(params.total)} params/GPU frozen + {_count(adapters)} LoRA: weights + fp32 grads + Adam; "
                + sync)
    elif trained:
        bytes_ = memory.training_state_bytes(params, dtype, dp, ep, cp, distributed_optimizer=on_gpu, tp=tp, etp=etp)
        shards = f"DP={dp}" if cp == 1 else f"DP x CP={dp * cp}"
        note = f"{_count(params.total)} params/GPU: weights + fp32 grads + Adam" + (
            f" (distributed optimizer over {shards})" if on_gpu and dp * cp > 1 else "")
    else:
        bytes_ = memory.weight_bytes(params.total, dtype)
        note = f"{_count(params.total)} params/GPU: weights only"
    uneven = ""
    if stages.first is not None or stages.last is not None:
        stage_sizes = PipelineSplit(hf["num_hidden_layers"], pp, vpp, stages).stage_sizes()
        uneven = f" (layers {'+'.join(stage_runs(stage_sizes))})"
    sizes = (f"TP={tp} PP={pp}{uneven}" + (f" VPP={vpp}" if vpp > 1 else "") + f" CP={cp} EP={ep}"
             + (f" ETP={etp}" if etp != tp else "") + f" DP={dp}")
    passes = role_passes(name, cfg, layout, on_gpu, hf)
    activations = memory.activation_bytes(memory.ModelShape.of(hf), passes, cfg.model.make_vocab_size_divisible_by)
    budgeted = getattr(cfg, str(name)).max_tokens_per_micro_batch is not None
    if not (name is Role.ACTOR and lora.rank):
        weights = memory.weight_bytes(params.total, dtype)
    return RolePlan(name, "Megatron" if trained else "Megatron forward", sizes, bytes_, note, weights, activations,
                    _activation_note(activations, passes, budgeted, cfg.actor.sequence_packing))


def role_passes(name: Role, cfg: Config, layout: dict, on_gpu: bool, hf: dict) -> memory.RolePasses:
    """How a Megatron role's passes hold activations, from its config section and its pool's layout (a colocated
    role shares the actor's processes, CP and VPP included; a separate one has CP 1)."""
    section = getattr(cfg, str(name))
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    budget, packing = section.max_tokens_per_micro_batch, cfg.actor.sequence_packing
    # A budget's bins never cut a sample: one longer than the budget runs alone (rl_megatron/sequences/bins.py).
    tokens = max(budget, longest) if budget else section.micro_batch_size * longest
    tp = layout["tp"]
    recompute = section if name.trainable else None  # a frozen role runs without a graph: nothing to recompute
    return memory.RolePasses(
        tokens=tokens, row_tokens=min(tokens, longest), dtype=cfg.model.dtype, tp=tp, pp=layout["pp"],
        vpp=layout.get("vpp", 1), cp=layout.get("cp", 1), etp=layout.get("etp", tp),
        stages=StageLayers.of_role(cfg, name),
        sequence_parallel=sequence_parallel_on(cfg.actor.sequence_parallel, tp, on_gpu, needs_sequence_parallel(hf)),
        attention="fused" if on_gpu else "spans" if packing else "local", trains=name.trainable,
        recompute=recompute.recompute_granularity if recompute else None,
        recompute_method=recompute.recompute_method if recompute else None,
        recompute_num_layers=recompute.recompute_num_layers if recompute else None,
        policy_head=not name.value_head, entropy_bonus=name is Role.ACTOR and cfg.actor.entropy_coeff > 0,
        routing=name in (Role.ACTOR, Role.REF) and carries_routing(cfg, hf, trainable=name is Role.ACTOR))


def _activation_note(activations: memory.Activations, passes: memory.RolePasses, budgeted: bool, packed: bool) -> str:
    recompute = f"{passes.recompute or 'no'} recompute"
    if passes.recompute == "full":
        n = passes.recompute_num_layers or 1
        recompute += (f" (block: the first {n} layer(s) of each chunk)" if passes.recompute_method == "block"
                      else f" (uniform: groups of {n} layer(s))")
    forward = f"{'log-probs' if passes.policy_head else 'values'} {gib_text(activations.forward)}"
    passes_text = f"update {gib_text(activations.update)}, {forward}" if passes.trains else forward
    split = f" / CP={passes.cp}" if passes.cp > 1 else ""
    padding = " (right-padded: padding not counted)" if budgeted and not packed else ""
    parts = [passes_text, f"{passes.tokens}{split} tokens per micro-batch{padding}", recompute if passes.trains else "",
             "sequence parallel" if passes.sequence_parallel else "",
             f"logits {gib_text(activations.logits)}" if activations.logits else "",
             f"routing {gib_text(activations.routing)}" if activations.routing else ""]
    return ", ".join(part for part in parts if part)


def _gpu_memory(measured_gib: Optional[float]) -> tuple[float, str, bool]:
    """GiB per GPU, where the figure comes from, and whether it is known: the user's GPU_MEMORY_GIB, else what was
    measured (nvidia-smi), else an H100's (assumed)."""
    if os.environ.get("GPU_MEMORY_GIB"):
        return float(os.environ["GPU_MEMORY_GIB"]), "GPU_MEMORY_GIB", True
    if measured_gib is not None:
        return measured_gib, "measured", True
    return DEFAULT_GPU_MEMORY_GIB, "assumed (H100 80GB); set GPU_MEMORY_GIB", False


def build_plan(cfg: Config, gpu_memory_gib: Optional[float] = None, on_gpu: bool = True,
               refuse_over_memory: bool = True) -> ClusterPlan:
    """The placement of every role and its memory per GPU; ConfigError (naming the key and the fix) when a
    layout does not fit the nodes, or (with `refuse_over_memory`, on GPUs whose memory is known) when a pool's
    estimate at its peak phase exceeds the GPU's memory; over an assumed size it is a warning. `cfg` must come from
    load_config (validated, defaults resolved)."""
    gib, gib_source, known = _gpu_memory(gpu_memory_gib)
    hf = model_config(cfg)
    total = memory.rank_parameters(hf).total
    specs, pools = worker_pools(cfg), []
    for spec in specs:
        first_node = sum(pool.nnodes for pool in pools)
        pools.append(Pool(spec.name, first_node, spec.nnodes, spec.gpus_per_node, spec.nodes_key, spec.gpus_key))
    plan = ClusterPlan(pools, gib, gib_source, known, on_gpu, total, cfg.model.dtype)
    for spec, pool in zip(specs, pools):
        for name in spec.roles:
            if name in (Role.ROLLOUT, Role.JUDGE):
                pool.roles.append(_engine_role(name, cfg, pool, hf, gib, on_gpu, plan))
            else:
                role_hf = role_model_config(cfg, name, hf)
                pool.roles.append(_megatron_role(name, pool, spec.layout, role_hf, cfg, on_gpu))

    for pool in pools:
        pool.phases = pool_phases(pool, cfg, on_gpu)
        if on_gpu and pool.memory_bytes > gib * memory.GIB:
            problem = over_memory(pool, cfg, gib, gib_source)
            if known and refuse_over_memory:
                raise ConfigError(problem[0].upper() + problem[1:])
            plan.warnings.append(problem + ("" if known else " Set GPU_MEMORY_GIB to your GPUs' memory: a plan over "
                                            "a known size is refused."))
    return plan


def _engine_role(name: Role, cfg: Config, pool: Pool, hf: dict, gib: float, on_gpu: bool,
                 plan: ClusterPlan) -> RolePlan:
    """The vLLM engines in `pool`, the policy's (`name` rollout: the model of `hf`) or a judge's own (judge: its
    model): their placement checked, their memory per GPU and, on GPU, how many samples their cache holds at once (a
    warning when the weights do not fit the engine's share)."""
    if name is Role.JUDGE:
        hf = read_hf_config(cfg.judge.model.path, JUDGE_PATH_KEY)
        r = judge_engine_settings(cfg, hf)
    else:
        r = cfg.rollout
    total = memory.rank_parameters(hf).total
    note = _check_engine(r.tensor_parallel_size, pool, f"{name}.tensor_parallel_size")
    pool.placement_notes.append(f"{name}: {note}")
    engines = pool.world // r.tensor_parallel_size
    engine_weights = memory.weight_bytes(total, cfg.model.dtype) // r.tensor_parallel_size
    if on_gpu:
        engine_bytes = int(r.gpu_memory_utilization * gib * memory.GIB)
        cache = sample_cache(hf, r.tensor_parallel_size, cfg.model.dtype)
        per_sample = cache.sample_bytes(r.max_model_len)
        state = f", {gib_text(cache.state_bytes)} of it Gated DeltaNet state" if cache.state_bytes else ""
        memory_note = (f"{name}.gpu_memory_utilization={r.gpu_memory_utilization} x {gib:g} GiB: weights "
                       f"{gib_text(engine_weights)} + KV cache, ~{max(0, engine_bytes - engine_weights) // per_sample} "
                       f"samples of max_model_len={r.max_model_len} at once ({gib_text(per_sample)} each{state})")
    else:
        engine_bytes = engine_weights + r.kv_cache_bytes
        memory_note = "weights + rollout.kv_cache_bytes"
    if on_gpu and engine_weights >= engine_bytes:
        plan.warnings.append(
            f"the vLLM engine's weights ({gib_text(engine_weights)} per GPU) do not fit its "
            f"{name}.gpu_memory_utilization={r.gpu_memory_utilization} share of {gib:g} GiB: raise "
            f"{name}.gpu_memory_utilization or {name}.tensor_parallel_size.")
    if on_gpu and cfg.actor.offload and r.placement == "colocated":
        memory_note += f"; asleep, its CUDA graphs stay (up to {gib_text(SLEEPING_ENGINE_BYTES)} counted)"
    return RolePlan(name, "vLLM", f"TP={r.tensor_parallel_size}, {engines} engines", engine_bytes, memory_note,
                    engine_weights)


def format_plan(cfg: Config, gpu_memory_gib: Optional[float] = None, on_gpu: bool = True) -> str:
    """The cluster plan as text: nodes, GPUs per role, each role's parallel layout and per-GPU memory.

    The trainer prints it at start: `print(format_plan(cfg, on_gpu=platform.has_cuda()))`. Raises ConfigError
    when a role's layout does not fit the nodes (TP or an engine across nodes, PP stages splitting a node)."""
    return render_plan(build_plan(cfg, gpu_memory_gib, on_gpu), cfg.model.path)


def render_plan(plan: ClusterPlan, model_path: str) -> str:
    on_gpu = plan.on_gpu
    device = "GPU" if on_gpu else "device (CPU slot)"
    lines = [f"Cluster plan: {plan.nnodes} node(s), {plan.total_gpus} {device}s "
             f"(Megatron rank order tp-cp-ep-dp-pp, ranks packed by node)",
             f"Model: {model_path}, {_count(plan.total_parameters)} parameters, {plan.dtype}"]
    for pool in plan.pools:
        lines.append(f"  {_nodes(pool.first_node, pool.nnodes)}: {pool.name} pool, {pool.nnodes} x "
                     f"{pool.gpus_per_node} = {pool.world} {device}s")
        for role in pool.roles:
            lines.append(f"    {role.name:<8}{role.engine:<18}{role.layout}")
        for note in pool.placement_notes:
            lines.append(f"      placement  {note}")
    capacity = f" of {plan.gpu_memory_gib:g} GiB ({plan.gpu_memory_source})" if on_gpu else ""
    lines.append(f"Memory per {device} (estimate with activations; CUDA context and fragmentation not "
                 f"included){capacity}:")
    for pool in plan.pools:
        parts = [f"{role.name} {gib_text(role.memory_bytes)} ({role.memory_note})" for role in pool.roles]
        largest = max(pool.roles, key=lambda role: role.activation_bytes)
        if largest.activation_bytes:
            parts.append(f"activations {gib_text(largest.activation_bytes)} (the {largest.name}'s; one pass at a time)")
        if len(pool.phases) > 1:  # the parts take turns: the figure is the largest phase's, not their sum
            lines.append(f"  {pool.name} pool: {gib_text(pool.memory_bytes)} at its peak ({pool.peak.name}), of "
                         + ", ".join(parts))
        else:
            lines.append(f"  {pool.name} pool: {gib_text(pool.memory_bytes)} = " + " + ".join(parts))
        phases = phase_line(pool, on_gpu)
        if phases:
            lines.append(f"    phases       {phases}")
        for role in pool.roles:
            if role.activations:
                lines.append(f"    activations  {role.name} {gib_text(role.activation_bytes)} ({role.activation_note})")
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)
