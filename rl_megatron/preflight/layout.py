"""A resolved config's parallel layouts: the actor's sizes against its devices and batches, the rollout engines',
the reference's and critic's, the model (config.json) against each of them, and the sequence parallelism and
activation recomputation of the roles that train against the model and their layouts."""
from __future__ import annotations

import dataclasses

from rl_megatron.config.schema import ActorConfig, Config, CriticConfig, MoeConfig
from rl_megatron.errors import ConfigError
from rl_megatron.models.checks import check_heads, check_model_layout, check_moe_model, check_sequence_length
from rl_megatron.config.choices import lora_modules
from rl_megatron.config.pools import uses_reference, worker_pools
from rl_megatron.models.family import family_of, moe_experts
from rl_megatron.models.hf_config import role_model_config
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers
from rl_megatron.roles import FROZEN_ROLES, Role


def check_actor_layout(cfg: Config) -> None:
    """The actor's TP/PP/VPP/CP/EP sizes against its devices, and its batches against its data-parallel ranks."""
    t, a, r, d = cfg.trainer, cfg.actor, cfg.rollout, cfg.data
    world = t.nnodes * t.n_gpus_per_node
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    vpp = a.virtual_pipeline_model_parallel_size
    # Context parallelism splits each sample of a packed row into 2 x CP chunks (causal attention balanced over the
    # CP ranks, as NeMo-RL does) and runs in Transformer Engine's attention; there is no right-padded path. Whether
    # the workers have TE on a CUDA device is known only where the model is built; the config decides this much.
    if cp > 1 and not a.sequence_packing:
        raise ConfigError(f"actor.context_parallel_size={cp} needs actor.sequence_packing=true: context parallelism "
                          "splits the samples of packed rows over the CP ranks. Set actor.sequence_packing=true, or "
                          "actor.context_parallel_size=1.")
    # A user's agent may fork its episode (its harness rewrites its history): the segments train as spans of one
    # sample, each attending to itself, which the packed layout expresses and the right-padded one and CP's cut do not.
    if r.agent.function is not None and (cp > 1 or not a.sequence_packing):
        key = f"actor.context_parallel_size={cp}" if cp > 1 else "actor.sequence_packing=false"
        raise ConfigError(f"rollout.agent.function's episodes fork where a harness rewrites its history, and the "
                          f"segments train as spans of one packed sample, which {key} cannot lay out: set "
                          "actor.sequence_packing=true and actor.context_parallel_size=1.")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"actor.virtual_pipeline_model_parallel_size={vpp} needs pipeline stages to interleave: set "
                          "actor.pipeline_model_parallel_size > 1, or actor.virtual_pipeline_model_parallel_size=1.")
    if world % (tp * pp * cp):
        raise ConfigError(
            f"The actor has {world} devices (trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node="
            f"{t.n_gpus_per_node}), which actor.tensor_model_parallel_size={tp} x "
            f"actor.pipeline_model_parallel_size={pp} x actor.context_parallel_size={cp} = {tp * pp * cp} does not "
            "divide. Choose sizes whose product divides the device count; the rest becomes data parallelism.")
    dp = world // (tp * pp * cp)
    ep, etp = a.expert_model_parallel_size, a.expert_tensor_parallel_size or tp
    if etp > tp:
        raise ConfigError(f"actor.expert_tensor_parallel_size={etp} exceeds actor.tensor_model_parallel_size={tp}: "
                          "experts split over at most the attention's TP ranks. Lower it (1 is common: whole experts, "
                          "spread by actor.expert_model_parallel_size).")
    if ep * etp < tp:
        # Then each rank runs its own sequence-parallel tokens through whole experts, and one update's expert
        # gradients differ from one device's (tests/distributed/test_gpt_oss.py measured it at TP=2, EP=1, ETP=1).
        raise ConfigError(f"actor.expert_model_parallel_size={ep} x actor.expert_tensor_parallel_size={etp} is "
                          f"below actor.tensor_model_parallel_size={tp}; Megatron's all-gather dispatcher then trains "
                          f"the experts on part of the tokens. Make their product at least {tp}: raise "
                          "actor.expert_model_parallel_size, or actor.expert_tensor_parallel_size.")
    if world % (etp * ep * pp):
        raise ConfigError(
            f"actor.expert_model_parallel_size={ep} x actor.expert_tensor_parallel_size={etp} x "
            f"actor.pipeline_model_parallel_size={pp} = {etp * ep * pp} must divide the actor's {world} devices (the "
            f"experts' layout; with expert TP = TP, EP must divide the data-parallel size {dp}). Choose a smaller "
            "actor.expert_model_parallel_size, or a smaller actor.expert_tensor_parallel_size.")
    _check_engines(cfg, world)
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} is not a multiple of "
                          f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; make it a multiple.")
    samples = a.ppo_mini_batch_size * r.n
    if samples % dp:
        raise ConfigError(
            f"A mini-batch holds actor.ppo_mini_batch_size x rollout.n = {samples} samples, which do not split over "
            f"data-parallel size {dp}. Change one of them.")
    if a.max_tokens_per_micro_batch is not None:
        _check_token_budget(samples // dp, pp if vpp > 1 else 1)
        return
    if samples % (dp * a.micro_batch_size):
        raise ConfigError(
            f"A mini-batch holds actor.ppo_mini_batch_size x rollout.n = {samples} samples, which is not a multiple "
            f"of data-parallel size {dp} x actor.micro_batch_size={a.micro_batch_size}. Change one of them.")
    micro_per_mini = samples // (dp * a.micro_batch_size)
    # Megatron-core 0.16.1's interleaved schedule runs micro-batches in groups of PP per model chunk and
    # rejects a count that does not split into such groups.
    if vpp > 1 and micro_per_mini % pp:
        raise ConfigError(
            f"actor.virtual_pipeline_model_parallel_size={vpp} needs the micro-batches of a mini-batch on one "
            f"data-parallel rank (actor.ppo_mini_batch_size x rollout.n / (data-parallel size {dp} x "
            f"actor.micro_batch_size={a.micro_batch_size}) = {micro_per_mini}) to be a multiple of "
            f"actor.pipeline_model_parallel_size={pp}. Change actor.micro_batch_size or actor.ppo_mini_batch_size.")


def _check_token_budget(samples_per_rank: int, micro_batch_multiple: int) -> None:
    """With a token budget a rank's mini-batch becomes as many micro-batches as its tokens need (every sample in
    one at worst). The interleaved schedule wants a multiple of PP of them, which needs that many samples."""
    if samples_per_rank % micro_batch_multiple:
        raise ConfigError(
            f"actor.virtual_pipeline_model_parallel_size > 1 runs micro-batches in groups of "
            f"actor.pipeline_model_parallel_size={micro_batch_multiple}, so a rank's mini-batch "
            f"(actor.ppo_mini_batch_size x rollout.n / data-parallel size = {samples_per_rank} samples) must be a "
            "multiple of it. Change actor.ppo_mini_batch_size or rollout.n.")


def _check_engines(cfg: Config, actor_devices: int) -> None:
    """The rollout engines: TP within a node of their pool, and the step's samples split evenly over them."""
    r, d = cfg.rollout, cfg.data
    if r.placement == "separate":
        engines = check_engine_pool("rollout", r)
    else:
        engines = _engines_on("rollout", r.tensor_parallel_size, actor_devices, "actor's",
                              "trainer.nnodes x trainer.n_gpus_per_node")
    if (d.train_batch_size * r.n) % engines:
        raise ConfigError(
            f"data.train_batch_size x rollout.n = {d.train_batch_size * r.n} samples do not split evenly over "
            f"{engines} rollout engines (devices / rollout.tensor_parallel_size). "
            "Change data.train_batch_size or rollout.n.")
    if d.max_prompt_length + r.max_tokens > r.max_model_len:
        raise ConfigError(f"data.max_prompt_length + rollout.max_tokens = {d.max_prompt_length + r.max_tokens} "
                          f"exceeds rollout.max_model_len={r.max_model_len}; raise max_model_len.")


def check_engine_pool(section: str, pool) -> int:
    """Engines on devices of their own (`pool`: the rollout section, or a judge's, at config path `section`): each
    engine's TP shards on one node or over whole nodes, and its TP dividing the pool's devices. Returns the engines."""
    tp, gpus = pool.tensor_parallel_size, pool.n_gpus_per_node
    if gpus % tp and tp % gpus:
        raise ConfigError(f"{section}.tensor_parallel_size={tp} must divide {section}.n_gpus_per_node={gpus} (an "
                          "engine's shards on one node), or be a multiple of it (whole nodes, for weights one node "
                          "cannot hold).")
    return _engines_on(section, tp, pool.nnodes * gpus, f"{section} pool's",
                       f"{section}.nnodes x {section}.n_gpus_per_node")


def _engines_on(section: str, tp: int, devices: int, whose: str, devices_keys: str) -> int:
    if devices % tp:
        raise ConfigError(f"{section}.tensor_parallel_size={tp} does not divide the {whose} {devices} devices "
                          f"({devices_keys}); choose a divisor.")
    return devices // tp


def check_role_layouts(cfg: Config) -> None:
    """The reference's, teacher's, reward model's and critic's layouts: colocated ones share the actor's processes (so
    its parallel layout); separate ones get their own devices. The frozen models run forward over the step's whole
    batch; the critic trains on mini-batches."""
    a, c = cfg.actor, cfg.critic
    frozen = [(str(name), getattr(cfg, name.value)) for name in FROZEN_ROLES]
    for name, role in (*frozen, ("critic", c)):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            mine, actors = getattr(role, key), getattr(a, key)
            if role.placement == "colocated" and mine != actors:
                raise ConfigError(f"{name}.{key}={mine} differs from actor.{key}={actors}, but {name}.placement="
                                  f"colocated runs the {name} in the actor's processes (its layout). Set "
                                  f"{name}.placement=separate, or remove {name}.{key}.")
    if cfg.data.train_batch_size % c.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
                          f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size}; make it a multiple.")
    for name, role, prompts in (*((name, role, cfg.data.train_batch_size) for name, role in frozen),
                                ("critic", c, c.ppo_mini_batch_size)):
        model_parallel = role.tensor_model_parallel_size * role.pipeline_model_parallel_size
        if role.placement == "colocated":
            # The actor's processes, hence its context-parallel groups too: CP ranks share a sample, not a DP slice.
            world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
            model_parallel *= a.context_parallel_size
        else:
            world = role.nnodes * role.n_gpus_per_node
        if world % model_parallel:
            raise ConfigError(f"{name}: {world} devices ({name}.nnodes x {name}.n_gpus_per_node) are not divisible "
                              f"by {name}.tensor_model_parallel_size x {name}.pipeline_model_parallel_size = "
                              f"{model_parallel}. Choose sizes whose product divides the device count.")
        dp = world // model_parallel
        samples = prompts * cfg.rollout.n
        per_micro_batch = 1 if role.max_tokens_per_micro_batch is not None else role.micro_batch_size
        if samples % (dp * per_micro_batch):
            split = (f"data-parallel size {dp}" if per_micro_batch == 1 else
                     f"data-parallel size {dp} x {name}.micro_batch_size={role.micro_batch_size}")
            raise ConfigError(f"{name}: a batch of {samples} samples (prompts x rollout.n) does not split into "
                              f"{split}. Change {name}.micro_batch_size or the mini-batch size.")


def check_model_against_layouts(cfg: Config, hf: dict) -> None:
    """The model (config.json with the moe section's overrides) against the actor's layout, the engines', each
    separate role's, and the moe section."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    length_key = "rollout.max_model_len"
    if r.max_model_len == d.max_prompt_length + r.max_tokens:  # its default: name what it is made of
        length_key += " = data.max_prompt_length + rollout.max_tokens"
    # The actor's first / last stage keys shape its pipeline only; a separate role splits its own evenly.
    stages = (("actor.num_layers_in_first_pipeline_stage", a.num_layers_in_first_pipeline_stage),
              ("actor.num_layers_in_last_pipeline_stage", a.num_layers_in_last_pipeline_stage))
    layouts = [("actor", a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                a.virtual_pipeline_model_parallel_size, a.expert_model_parallel_size, stages)]
    layouts += [(name, role.tensor_model_parallel_size, role.pipeline_model_parallel_size, 1, 1, (None, None))
                for name, role in (("ref", cfg.ref), ("critic", cfg.critic)) if role.placement == "separate"]
    for index, (role, tp, pp, vpp, ep, (first, last)) in enumerate(layouts):
        check_model_layout(hf, (f"{role}.tensor_model_parallel_size", tp), (f"{role}.pipeline_model_parallel_size", pp),
                           (f"{role}.expert_model_parallel_size", ep),
                           (f"{role}.virtual_pipeline_model_parallel_size", vpp), first_stage=first, last_stage=last)
        check_heads(hf, ("rollout.tensor_parallel_size", r.tensor_parallel_size))
        check_sequence_length(hf, (length_key, r.max_model_len))
        if index == 0:  # the experts and adapters exist in the actor's layout only (separate roles run at EP 1)
            _check_moe_section(cfg, hf)
            check_lora(cfg, hf)


def check_own_model_against_layout(cfg: Config, role: Role, role_hf: dict) -> None:
    """A model of its own (the teacher's, the reward model's: <role>.model.path's config.json) against its layout:
    the actor's processes' when colocated (its TP and PP, which are the actor's, the actor's virtual stages, the
    actor's EP for an MoE model), else its own pool's; and the sequences it scores against its positions."""
    section, a, r = getattr(cfg, role.value), cfg.actor, cfg.rollout
    colocated = section.placement == "colocated"
    vpp = a.virtual_pipeline_model_parallel_size if colocated else 1
    ep = a.expert_model_parallel_size if colocated and moe_experts(role_hf) else 1
    source = f"{role}.model.path's config.json"
    check_model_layout(role_hf, (f"{role}.tensor_model_parallel_size", section.tensor_model_parallel_size),
                       (f"{role}.pipeline_model_parallel_size", section.pipeline_model_parallel_size),
                       ("actor.expert_model_parallel_size", ep), ("actor.virtual_pipeline_model_parallel_size", vpp),
                       source=source)
    check_sequence_length(role_hf, ("rollout.max_model_len", r.max_model_len), source)


def check_hybrid_layers(cfg: Config, hf: dict, cuda: bool, transformer_engine: bool) -> None:
    """The hybrid families (Gated DeltaNet layers or zero-centred norms: Qwen3-Next, Qwen3.5) are built from
    Megatron's local layers only: on a CUDA run where Transformer Engine imports (whose layers every other family
    gets there), a role holding one is refused here, naming it, before a worker fails at building it."""
    if not (cuda and transformer_engine):
        return
    for name in (name for pool in worker_pools(cfg) for name in pool.roles if name.has_model):
        role_hf = role_model_config(cfg, name, hf)
        family = family_of(role_hf)
        if family.gated_delta_net or family.zero_centred_norms:
            raise ConfigError(
                f"the {name}'s model (model_type={role_hf['model_type']!r}) is a hybrid of Gated DeltaNet and "
                "attention layers, which rl_megatron builds from Megatron's local layers only, and Transformer "
                "Engine imports here, whose layers every worker would build: run in an environment without it "
                "(pip uninstall transformer-engine), where the local layers and the torch or fla delta-rule kernels "
                "run (docs/model-families.md).")


def check_lora(cfg: Config, hf: dict) -> None:
    """actor.lora: adapters where the model has the modules (not yet the MoE experts' nor latent attention's); no
    separate reference (the actor with its adapters off is the reference)."""
    lora = cfg.actor.lora
    if not lora.rank:
        return
    family = family_of(hf)
    if family.mla:
        raise ConfigError(f"actor.lora.rank={lora.rank}: model.path's config.json has model_type="
                          f"{hf['model_type']!r}, whose multi-head latent attention (q_a_proj, kv_a_proj_with_mqa, "
                          "...) has no LoRA adapters yet: set actor.lora.rank=0 (full fine-tuning).")
    if family.gated_delta_net:
        raise ConfigError(f"actor.lora.rank={lora.rank}: model.path's config.json has model_type="
                          f"{hf['model_type']!r}, whose Gated DeltaNet layers (in_proj, conv1d, out_proj) and gated "
                          "attention have no LoRA adapters yet: set actor.lora.rank=0 (full fine-tuning).")
    mlp = [m for m in lora_modules(lora.target_modules) if m in ("gate_proj", "up_proj", "down_proj")]
    if moe_experts(hf) and mlp:
        raise ConfigError(f"actor.lora.target_modules includes {', '.join(mlp)}, but model.path's config.json has "
                          f"model_type={hf['model_type']!r}, whose experts have no LoRA adapters yet: set "
                          "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj] (attention only), or "
                          "actor.lora.rank=0.")
    if "lm_head" in lora.target_modules and hf.get("tie_word_embeddings"):
        raise ConfigError("actor.lora.target_modules includes lm_head, but model.path's config.json ties the output "
                          "layer to the embedding (tie_word_embeddings), which the engines hold as one tensor: "
                          "remove lm_head from actor.lora.target_modules.")
    if uses_reference(cfg) and cfg.ref.placement == "separate":
        raise ConfigError("ref.placement=separate: with actor.lora the reference policy is the actor with its adapters "
                          "off, and no reference weights are held anywhere; remove ref.placement (and ref's other "
                          "keys).")


def _check_moe_section(cfg: Config, hf: dict) -> None:
    """The moe section and the expert layout against the (overridden) model config."""
    a = cfg.actor
    if a.router_replay != "disabled":
        check_router_replay(cfg, hf)
    if not moe_experts(hf):
        changed = [f.name for f in dataclasses.fields(MoeConfig) if getattr(cfg.moe, f.name) != f.default]
        if changed or a.expert_tensor_parallel_size not in (None, a.tensor_model_parallel_size):
            key = f"moe.{changed[0]}" if changed else "actor.expert_tensor_parallel_size"
            raise ConfigError(f"{key} is set, but model.path's config.json has model_type={hf['model_type']!r}, a "
                              f"dense model without experts; remove {key} or use an MoE model (qwen3_moe, mixtral).")
        return
    check_moe_model(hf, ("actor.expert_tensor_parallel_size",
                         a.expert_tensor_parallel_size or a.tensor_model_parallel_size))


def check_router_replay(cfg: Config, hf: dict) -> None:
    """actor.router_replay: an MoE model; R3 with the engines' routing."""
    a = cfg.actor
    if not moe_experts(hf):
        raise ConfigError(f"actor.router_replay={a.router_replay} replays MoE routing, but model.path's config.json "
                          f"has model_type={hf['model_type']!r}, a dense model without experts; set "
                          "actor.router_replay=disabled.")
    if a.router_replay == "R3" and cfg.moe.engine_routing is False:
        raise ConfigError("actor.router_replay=R3 replays the rollout engine's routing, but moe.engine_routing=false "
                          "keeps the engines from returning it: remove moe.engine_routing (or set it to true), or "
                          "use actor.router_replay=R2.")


def check_moe_knobs(cfg: Config) -> None:
    """moe.num_experts and moe.top_k reshape the model, so they need weights that do not come from model.path."""
    for key, value in (("moe.num_experts", cfg.moe.num_experts), ("moe.top_k", cfg.moe.top_k)):
        if value is not None and not cfg.model.random_init:
            raise ConfigError(f"{key}={value} changes the model's shape, but model.random_init=false loads "
                              f"model.path's weights, which have config.json's; set model.random_init=true, or "
                              f"remove {key}.")


def check_activations(cfg: Config, hf: dict) -> None:
    """Sequence parallelism and activation recomputation of the roles that train (the actor; the critic when
    enabled) against the model and their layouts: what Megatron would otherwise assert on, or fail at, in a worker.
    The frozen reference follows actor.sequence_parallel and never recomputes (`models.activations`)."""
    a, c = cfg.actor, cfg.critic
    # A colocated critic runs in the actor's processes (its pipeline and chunks); a separate one without VPP.
    roles = [("actor", a, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
              a.virtual_pipeline_model_parallel_size, StageLayers.of_role(cfg, Role.ACTOR))]
    if c.enable:
        roles.append(("critic", c, c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
                      a.virtual_pipeline_model_parallel_size if c.placement == "colocated" else 1,
                      StageLayers.of_role(cfg, Role.CRITIC)))
    for name, section, tp, pp, vpp, stages in roles:
        if a.sequence_parallel is False and tp > 1 and moe_experts(hf):
            raise ConfigError(
                f"actor.sequence_parallel=false, but model.path is an MoE model (model_type={hf['model_type']!r}) "
                f"that the {name} trains at {name}.tensor_model_parallel_size={tp}: Megatron trains MoE layers at "
                "TP > 1 only with sequence parallelism. Remove actor.sequence_parallel (on at TP > 1 by default), or "
                f"set {name}.tensor_model_parallel_size=1.")
        _check_recompute(name, section, PipelineSplit(hf["num_hidden_layers"], pp, vpp, stages).chunk_sizes())


def _check_recompute(name: str, section: ActorConfig | CriticConfig, chunk_sizes: list[int]) -> None:
    """A role's recompute_* keys (ActorConfig's or CriticConfig's) as Megatron's TransformerConfig and
    TransformerBlock take them: full needs a method and a layer count that fit the model chunks (`chunk_sizes`:
    their distinct layer counts, several with uneven pipeline stages); selective takes neither (it recomputes the
    attention core of every layer)."""
    granularity, method, layers = section.recompute_granularity, section.recompute_method, section.recompute_num_layers
    extras = [f"{name}.{key}={value}" for key, value in (("recompute_method", method),
                                                          ("recompute_num_layers", layers)) if value is not None]
    if granularity is None and extras:
        raise ConfigError(f"{' and '.join(extras)} apply to full recomputation, which is off: set "
                          f"{name}.recompute_granularity=full, or remove them.")
    if granularity == "selective" and extras:
        raise ConfigError(f"{name}.recompute_granularity=selective recomputes the attention core of every layer; "
                          f"{' and '.join(extras)} apply to full recomputation only. Remove them, or set "
                          f"{name}.recompute_granularity=full.")
    if granularity != "full":
        return
    if method is None or layers is None:
        raise ConfigError(f"{name}.recompute_granularity=full needs {name}.recompute_method (uniform: layers "
                          f"recomputed in groups of recompute_num_layers; block: only the first recompute_num_layers "
                          f"layers of each model chunk) and {name}.recompute_num_layers; e.g. "
                          f"{name}.recompute_method=uniform {name}.recompute_num_layers=1 (every layer, least memory).")
    counts = " / ".join(map(str, chunk_sizes))
    if method == "uniform" and any(size % layers for size in chunk_sizes):
        # Megatron's uniform groups run past the chunk's last layer otherwise (an IndexError in the first update).
        divisors = [d for d in range(1, chunk_sizes[0] + 1) if all(size % d == 0 for size in chunk_sizes)]
        raise ConfigError(f"{name}.recompute_method=uniform cuts each model chunk's {counts} layers into groups of "
                          f"{name}.recompute_num_layers={layers}, which must divide them; choose a divisor of "
                          f"{counts} ({', '.join(map(str, divisors))}; 1: every layer on its own, least memory).")
    if method == "block" and layers > chunk_sizes[-1]:
        raise ConfigError(f"{name}.recompute_num_layers={layers} exceeds the {counts} layers of each model chunk "
                          f"(a pipeline stage's layers / virtual stages) that {name}.recompute_method=block counts in; "
                          f"use at most {chunk_sizes[-1]} ({chunk_sizes[-1]}: every layer).")
