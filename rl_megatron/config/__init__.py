"""Configuration: YAML + `key=value` overrides onto the typed schema, validated before anything starts."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rl_megatron.config.schema import Config


class ConfigError(ValueError):
    """A configuration problem, worded for the user: what is wrong, where, and how to fix it."""


def _schema_keys(cls, prefix: str = "") -> dict[str, Any]:
    """Every dotted key the schema declares, mapped to its field type (dataclass for sections)."""
    keys = {}
    for f in dataclasses.fields(cls):
        dotted = prefix + f.name
        keys[dotted] = f.type
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            _SECTIONS.add(dotted)
            keys.update(_schema_keys(type(default), dotted + "."))
    return keys


_SECTIONS: set[str] = set()  # dotted keys that hold a section (trainer, actor.optim, ...), filled by _schema_keys
_KEYS = _schema_keys(Config)


def one_line(text) -> str:
    """Any (multi-line) message as one line."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _omegaconf_reason(err: OmegaConfBaseException) -> str:
    """The first line of an OmegaConf error: its reason, without the full_key/reference_type trailer."""
    text = str(getattr(err, "msg", None) or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _unknown_key(dotted: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(dotted, list(_KEYS), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else " See rl_megatron/config/schema.py for the keys."
    return ConfigError(f"Unknown config key '{dotted}' in {where}.{hint}")


def _leaves(tree: dict, where: str, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Flatten a (nested) mapping into (dotted key, value, where) settings, rejecting what the schema lacks."""
    settings = []
    for key, value in tree.items():
        dotted = prefix + str(key)
        if dotted not in _KEYS:
            raise _unknown_key(dotted, where)
        if dotted in _SECTIONS:
            if value is None:  # an empty section (`trainer:` with every key commented out)
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"Config key '{dotted}' (in {where}) is a section, not a value: set its keys "
                                  f"instead, e.g. {dotted}.<key>=... (see rl_megatron/config/schema.py).")
            settings += _leaves(value, where, dotted + ".")
        elif isinstance(value, dict):
            raise ConfigError(f"Config key '{dotted}' (in {where}) takes a single value, not a mapping of "
                              f"{sorted(map(str, value))}.")
        else:
            settings.append((dotted, value, where))
    return settings


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"Config file '{path}' does not exist. Pass an existing YAML, e.g. configs/demo_cpu.yaml.")
    if not os.path.isfile(path):
        raise ConfigError(f"Config file '{path}' is not a file. Pass a YAML file, e.g. configs/demo_cpu.yaml.")
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # yaml.YAMLError and friends: report them all the same way
        problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = f"{problem}{where}" if problem else one_line(err)
        raise ConfigError(f"Config file '{path}' is not valid YAML: {detail}. Fix the YAML syntax there.") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping of sections (trainer:, model:, ...), "
                          f"not a {type(tree).__name__}.")
    return tree


def _parse_override(item: str) -> list[tuple[str, Any, str]]:
    where = "the command-line overrides"
    if "=" not in item:
        raise ConfigError(f"Override '{item}' is not of the form key=value (e.g. trainer.total_steps=5).")
    key, value = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"Override '{item}' has no key before '=' (e.g. trainer.total_steps=5).")
    if key not in _KEYS:
        raise _unknown_key(key, where)
    try:  # parse the value as YAML, the way OmegaConf does: 5 -> int, 1e-3 -> float, [a, b] -> list, null -> None
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]))
    except Exception as err:
        raise ConfigError(f"Override '{item}': the value of '{key}' is not valid YAML "
                          f"({getattr(err, 'problem', None) or one_line(err)}). Quote it or fix its brackets.") from None
    return _leaves(tree, where)


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Merge `path` (YAML) and `overrides` (`a.b=value`) onto the schema and validate the result."""
    settings = _leaves(_read_yaml(path), f"'{path}'") if path is not None else []
    for item in overrides:
        settings += _parse_override(item)
    merged = OmegaConf.structured(Config)
    for key, value, where in settings:  # one key at a time, so that a bad value is reported with its key
        try:
            OmegaConf.update(merged, key, value, merge=False)
        except OmegaConfBaseException as err:
            raise ConfigError(f"Config key '{key}' (in {where}) has a bad value {value!r}: "
                              f"{_omegaconf_reason(err)}. See its type in "
                              "rl_megatron/config/schema.py.") from None
    try:
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            hint = " (a Hugging Face model folder)" if missing[0] == "model.path" else ""
            raise ConfigError(f"Config key '{missing[0]}' must be set{hint}: in the YAML or as {missing[0]}=...")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # e.g. an interpolation ${...} that does not resolve
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"Config key '{key}' has a bad value: {_omegaconf_reason(err)}.") from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def read_hf_config(model_path: str) -> dict:
    if not os.path.isdir(model_path):
        raise ConfigError(
            f"model.path='{model_path}' is not a folder (relative paths count from {os.getcwd()}). Point model.path "
            "at a Hugging Face model folder (config.json, tokenizer files, *.safetensors).")
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"model.path='{model_path}' has no config.json. Point model.path at a Hugging Face model folder "
            "(config.json, tokenizer files, *.safetensors).")
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"model.path='{model_path}': config.json is not readable JSON ({one_line(err)}). "
                          "Fix or replace the file.") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.path='{model_path}': config.json must hold a JSON object, "
                          f"not a {type(hf).__name__}.")
    return hf


def validate(cfg: Config) -> None:
    """Check everything that can be checked before a process starts; raise ConfigError on the first problem."""
    t, a, r, d = cfg.trainer, cfg.actor, cfg.rollout, cfg.data
    length_key = "rollout.max_model_len"
    if r.max_model_len is None:  # derived: the longest sequence the data and sampling settings allow
        r.max_model_len = d.max_prompt_length + r.max_tokens
        length_key = "data.max_prompt_length + rollout.max_tokens"
    _positive(("trainer.total_steps", t.total_steps), ("trainer.nnodes", t.nnodes),
              ("trainer.n_gpus_per_node", t.n_gpus_per_node),
              ("actor.tensor_model_parallel_size", a.tensor_model_parallel_size),
              ("actor.pipeline_model_parallel_size", a.pipeline_model_parallel_size),
              ("actor.virtual_pipeline_model_parallel_size", a.virtual_pipeline_model_parallel_size),
              ("actor.context_parallel_size", a.context_parallel_size),
              ("actor.expert_model_parallel_size", a.expert_model_parallel_size),
              ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size), ("actor.ppo_epochs", a.ppo_epochs),
              ("actor.micro_batch_size", a.micro_batch_size), ("rollout.n", r.n),
              ("rollout.max_tokens", r.max_tokens), ("rollout.tensor_parallel_size", r.tensor_parallel_size),
              ("data.train_batch_size", d.train_batch_size), ("data.max_prompt_length", d.max_prompt_length),
              ("rollout.max_model_len", r.max_model_len), ("rollout.kv_cache_bytes", r.kv_cache_bytes),
              ("model.make_vocab_size_divisible_by", cfg.model.make_vocab_size_divisible_by),
              ("resharding.bucket_mb", cfg.resharding.bucket_mb),
              ("ray.object_store_memory", cfg.ray.object_store_memory))
    _positive(("rollout.val_n", r.val_n))
    if (t.val_every or t.val_before_train) and not d.val_files:
        raise ConfigError(f"trainer.val_every={t.val_every} / trainer.val_before_train={t.val_before_train} validate "
                          "on data.val_files, which is empty: set data.val_files (parquet files, e.g. from "
                          "`python -m rl_megatron.data.prepare`), or trainer.val_every=0 and "
                          "trainer.val_before_train=false.")
    for key, value in (("trainer.val_every", t.val_every), ("trainer.val_generations_to_log", t.val_generations_to_log),
                       ("trainer.keep_last", t.keep_last)):
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative (0 turns it off).")
    if t.save_every < -1:
        raise ConfigError(f"trainer.save_every={t.save_every}: use N > 0 (every N steps), 0 (at the end and when "
                          "stopped) or -1 (never).")
    if t.resume not in ("auto", "off") and not os.path.isdir(t.resume):
        raise ConfigError(f"trainer.resume={t.resume!r} is neither auto, off, nor an existing checkpoint folder "
                          "(e.g. runs/<experiment>/checkpoints/global_step_40).")
    if cfg.model.checkpoint is not None:
        if cfg.model.random_init:
            raise ConfigError("model.checkpoint and model.random_init=true both say where the initial weights come "
                              "from; keep one.")
        if not os.path.isdir(cfg.model.checkpoint):
            raise ConfigError(f"model.checkpoint={cfg.model.checkpoint!r} is not a folder; make one with `python -m "
                              "rl_megatron.convert from-hf --hf MODEL --out CKPT`.")
    if cfg.ray.num_cpus is not None:
        _positive(("ray.num_cpus", cfg.ray.num_cpus))
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling.")
    if r.top_k != -1 and r.top_k < 1:
        raise ConfigError(f"rollout.top_k={r.top_k} must be -1 (disabled) or at least 1.")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1], e.g. 0.5.")
    for key, value in (("actor.optim.lr", a.optim.lr), ("actor.optim.min_lr", a.optim.min_lr),
                       ("actor.optim.lr_warmup_steps", a.optim.lr_warmup_steps),
                       ("actor.optim.weight_decay", a.optim.weight_decay),
                       ("actor.optim.clip_grad", a.optim.clip_grad),
                       ("actor.clip_ratio_low", a.clip_ratio_low), ("actor.clip_ratio_high", a.clip_ratio_high)):
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative.")
    from rl_megatron.data.build import validate_data_config  # here: rl_megatron.data imports this module

    validate_data_config(cfg.data)
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype='{cfg.model.dtype}' is not supported: use float32 or bfloat16.")
    if a.optim.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ConfigError(f"actor.optim.lr_decay_style='{a.optim.lr_decay_style}': use constant, linear or cosine.")
    _validate_algorithm(cfg)
    _validate_reward(cfg)
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 (RL needs sampling; use 1.0).")

    world = t.nnodes * t.n_gpus_per_node
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    vpp = a.virtual_pipeline_model_parallel_size
    if cp != 1:
        raise ConfigError(f"actor.context_parallel_size={cp}: only 1 is supported yet; set "
                          "actor.context_parallel_size=1.")
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
    ep = a.expert_model_parallel_size
    etp = a.expert_tensor_parallel_size or tp
    if etp > tp:
        raise ConfigError(f"actor.expert_tensor_parallel_size={etp} exceeds actor.tensor_model_parallel_size={tp}: "
                          "experts split over at most the attention's TP ranks. Lower it (1 is common: whole experts, "
                          "spread by actor.expert_model_parallel_size).")
    if world % (etp * ep * pp):
        raise ConfigError(
            f"actor.expert_model_parallel_size={ep} x actor.expert_tensor_parallel_size={etp} x "
            f"actor.pipeline_model_parallel_size={pp} = {etp * ep * pp} must divide the actor's {world} devices (the "
            f"experts' layout; with expert TP = TP, EP must divide the data-parallel size {dp}). Choose a smaller "
            "actor.expert_model_parallel_size, or a smaller actor.expert_tensor_parallel_size.")
    _one_of("rollout.placement", r.placement, PLACEMENTS)
    if r.placement == "separate":
        _positive(("rollout.nnodes", r.nnodes), ("rollout.n_gpus_per_node", r.n_gpus_per_node))
        engine_devices = r.nnodes * r.n_gpus_per_node
        whose = ("rollout pool's", "rollout.nnodes x rollout.n_gpus_per_node")
        if r.n_gpus_per_node % r.tensor_parallel_size:
            raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide "
                              f"rollout.n_gpus_per_node={r.n_gpus_per_node}: an engine's shards stay on one node.")
    else:
        engine_devices, whose = world, ("actor's", "trainer.nnodes x trainer.n_gpus_per_node")
    if engine_devices % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} does not divide the {whose[0]} "
                          f"{engine_devices} devices ({whose[1]}); choose a divisor.")
    engines = engine_devices // r.tensor_parallel_size
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} is not a multiple of "
                          f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; make it a multiple.")
    samples = a.ppo_mini_batch_size * r.n
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
    if (d.train_batch_size * r.n) % engines:
        raise ConfigError(
            f"data.train_batch_size x rollout.n = {d.train_batch_size * r.n} samples do not split evenly over "
            f"{engines} rollout engines (devices / rollout.tensor_parallel_size). "
            "Change data.train_batch_size or rollout.n.")
    from rl_megatron.resharding.channels import CHANNELS

    if cfg.resharding.channel not in CHANNELS:
        raise ConfigError(f"resharding.channel={cfg.resharding.channel} is not one of {', '.join(CHANNELS)}.")
    if d.max_prompt_length + r.max_tokens > r.max_model_len:
        raise ConfigError(f"data.max_prompt_length + rollout.max_tokens = {d.max_prompt_length + r.max_tokens} "
                          f"exceeds rollout.max_model_len={r.max_model_len}; raise max_model_len.")

    _resolve_roles(cfg)
    _validate_moe_knobs(cfg)
    hf = model_config(cfg)
    _validate_model(hf, "actor", tp, pp, vpp, ep, r.tensor_parallel_size, r.max_model_len, length_key)
    _validate_moe_model(cfg, hf, etp)
    for name, role in (("ref", cfg.ref), ("critic", cfg.critic)):
        if role.placement == "separate":
            _validate_model(hf, name, role.tensor_model_parallel_size, role.pipeline_model_parallel_size, 1, 1,
                            r.tensor_parallel_size, r.max_model_len, length_key)


MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")


def moe_hf_overrides(cfg: Config, hf: dict) -> dict:
    """The config.json fields that moe.num_experts and moe.top_k replace: Megatron builds from the result, and the
    vLLM engines get the same fields as hf_overrides (so both sides route alike)."""
    from rl_megatron.models.weight_tables import MOE_FAMILIES

    if hf.get("model_type") not in MOE_FAMILIES:
        return {}
    overrides = {}
    if cfg.moe.num_experts is not None:
        # Qwen's configs say num_experts; transformers >= 5 writes num_local_experts: replace whichever is there.
        overrides.update({key: cfg.moe.num_experts for key in ("num_experts", "num_local_experts") if key in hf})
    if cfg.moe.top_k is not None:
        overrides["num_experts_per_tok"] = cfg.moe.top_k
    return overrides


def model_config(cfg: Config) -> dict:
    """model.path's config.json with the moe section's overrides: the model every process builds."""
    hf = read_hf_config(cfg.model.path)
    return {**hf, **moe_hf_overrides(cfg, hf)}


def _validate_moe_knobs(cfg: Config) -> None:
    """The moe section's values on their own."""
    moe = cfg.moe
    for key, value in (("moe.num_experts", moe.num_experts), ("moe.top_k", moe.top_k)):
        if value is None:
            continue
        _positive((key, value))
        if not cfg.model.random_init:
            raise ConfigError(f"{key}={value} changes the model's shape, but model.random_init=false loads "
                              f"model.path's weights, which have config.json's; set model.random_init=true, or "
                              f"remove {key}.")
    for key, value in (("moe.aux_loss_coeff", moe.aux_loss_coeff), ("moe.z_loss_coeff", moe.z_loss_coeff)):
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative (0 turns it off).")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"moe.capacity_factor={moe.capacity_factor} must be > 0 (e.g. 1.25), or null to drop no "
                          "tokens.")
    _one_of("moe.token_drop_policy", moe.token_drop_policy, MOE_DROP_POLICIES)
    if moe.token_dispatcher is not None:
        _one_of("moe.token_dispatcher", moe.token_dispatcher, MOE_DISPATCHERS)
    if moe.router_dtype is not None:
        _one_of("moe.router_dtype", moe.router_dtype, ROUTER_DTYPES)
    if cfg.actor.expert_tensor_parallel_size is not None:
        _positive(("actor.expert_tensor_parallel_size", cfg.actor.expert_tensor_parallel_size))


def _validate_moe_model(cfg: Config, hf: dict, etp: int) -> None:
    """The moe section and the expert layout against the (overridden) model config."""
    from rl_megatron.config.schema import MoeConfig
    from rl_megatron.models.weight_tables import MOE_FAMILIES, moe_experts

    moe, a = cfg.moe, cfg.actor
    experts = moe_experts(hf)
    if not experts:
        changed = [f.name for f in dataclasses.fields(MoeConfig) if getattr(moe, f.name) != f.default]
        if changed or a.expert_tensor_parallel_size not in (None, a.tensor_model_parallel_size):
            key = f"moe.{changed[0]}" if changed else "actor.expert_tensor_parallel_size"
            raise ConfigError(f"{key} is set, but model.path's config.json has model_type={hf['model_type']!r}, a "
                              f"dense model without experts; remove {key} or use an MoE model (qwen3_moe, mixtral).")
        return
    family = MOE_FAMILIES[hf["model_type"]]
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key):
            raise ConfigError(f"The model's config.json (model.path) has {key}={hf[key]}: shared experts are not "
                              "supported yet (Qwen3-MoE and Mixtral have none); use a model without them.")
    top_k = hf["num_experts_per_tok"]
    if top_k > experts:
        raise ConfigError(f"Each token goes to num_experts_per_tok={top_k} experts (moe.top_k or config.json) of only "
                          f"{experts} (moe.num_experts or config.json); lower moe.top_k.")
    if top_k == 1 and hf.get("norm_topk_prob", family.renormalises_top_k):
        raise ConfigError("Top-1 routing with the weights renormalised over the top-k (config.json norm_topk_prob, "
                          "always for Mixtral) gives every token the weight 1, so the router would get no gradient "
                          "(Megatron refuses it): use moe.top_k >= 2.")
    if hf[family.width_key] % etp:
        raise ConfigError(f"The experts' width {family.width_key}={hf[family.width_key]} (model.path's config.json) "
                          f"does not split over actor.expert_tensor_parallel_size={etp} (default: the TP size) ranks; "
                          "choose a divisor.")


def _one_of(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}='{value}' is unknown: use one of {', '.join(choices)}.")


def uses_reference(cfg: Config) -> bool:
    """Whether a KL term (in the loss or in the reward) needs the reference policy."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


@dataclasses.dataclass(frozen=True)
class WorkerPool:
    """Processes on nodes of their own: the roles they host, how many (and the config section that says so), and the
    Megatron layout of their models (none for the engines' pool)."""

    name: str  # its first role: "actor" (with every role colocated with it), "rollout", "ref" or "critic"
    roles: tuple[str, ...]
    nnodes: int
    gpus_per_node: int
    section: str  # "trainer", "rollout", "ref" or "critic"
    layout: dict  # tp, pp (and for the actor's pool vpp, cp, ep, etp)

    @property
    def nodes_key(self) -> str:
        return f"{self.section}.nnodes"

    @property
    def gpus_key(self) -> str:
        return f"{self.section}.n_gpus_per_node"


def worker_pools(cfg: Config) -> list[WorkerPool]:
    """The pools in node order: the actor's (with the engines unless rollout.placement=separate, and the colocated
    reference and critic), then the separate ones: engines, reference, critic. Roles in a pool: actor, rollout,
    ref, critic order."""
    a, r = cfg.actor, cfg.rollout
    engines_apart = r.placement == "separate"
    actor_roles = ["actor"] if engines_apart else ["actor", "rollout"]
    engine_pool = WorkerPool("rollout", ("rollout",), r.nnodes, r.n_gpus_per_node, "rollout", {})
    separate = [engine_pool] if engines_apart else []
    for name, role, wanted in (("ref", cfg.ref, uses_reference(cfg)), ("critic", cfg.critic, cfg.critic.enable)):
        if wanted and role.placement == "colocated":
            actor_roles.append(name)
        elif wanted:
            layout = {"tp": role.tensor_model_parallel_size, "pp": role.pipeline_model_parallel_size}
            separate.append(WorkerPool(name, (name,), role.nnodes, role.n_gpus_per_node, name, layout))
    tp = a.tensor_model_parallel_size
    actor_layout = {"tp": tp, "pp": a.pipeline_model_parallel_size, "vpp": a.virtual_pipeline_model_parallel_size,
                    "cp": a.context_parallel_size, "ep": a.expert_model_parallel_size,
                    "etp": a.expert_tensor_parallel_size or tp}
    return [WorkerPool("actor", tuple(actor_roles), cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, "trainer",
                       actor_layout), *separate]


def _validate_algorithm(cfg: Config) -> None:
    """Names, ranges and combinations of the RL algorithm's settings."""
    from rl_megatron.algorithms import ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, NEEDS_CRITIC

    alg, a, c = cfg.algorithm, cfg.actor, cfg.critic
    _one_of("algorithm.adv_estimator", alg.adv_estimator, ESTIMATORS)
    _one_of("actor.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _one_of("critic.loss_agg_mode", c.loss_agg_mode, LOSS_AGG_MODES)
    _one_of("actor.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
    _one_of("algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS)
    _one_of("algorithm.kl_ctrl.type", alg.kl_ctrl.type, ("fixed", "adaptive"))
    _one_of("ref.placement", cfg.ref.placement, PLACEMENTS)
    _one_of("critic.placement", c.placement, PLACEMENTS)
    for key, value in (("algorithm.gamma", alg.gamma), ("algorithm.lam", alg.lam)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}={value} must be in [0, 1].")
    for key, value in (("actor.entropy_coeff", a.entropy_coeff), ("actor.kl_loss_coef", a.kl_loss_coef),
                       ("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef), ("critic.cliprange_value", c.cliprange_value),
                       ("critic.warmup_steps", c.warmup_steps), ("critic.optim.lr", c.optim.lr),
                       ("critic.optim.min_lr", c.optim.min_lr), ("critic.optim.weight_decay", c.optim.weight_decay),
                       ("critic.optim.clip_grad", c.optim.clip_grad),
                       ("critic.optim.lr_warmup_steps", c.optim.lr_warmup_steps)):
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative.")
    _positive(("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon), ("ref.nnodes", cfg.ref.nnodes),
              ("ref.n_gpus_per_node", cfg.ref.n_gpus_per_node), ("critic.nnodes", c.nnodes),
              ("critic.n_gpus_per_node", c.n_gpus_per_node))
    if alg.kl_ctrl.target_kl <= 0:
        raise ConfigError(f"algorithm.kl_ctrl.target_kl={alg.kl_ctrl.target_kl} must be > 0.")
    if c.optim.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ConfigError(f"critic.optim.lr_decay_style='{c.optim.lr_decay_style}': use constant, linear or cosine.")
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip's bound, e.g. 3.0), or null "
                          "to disable dual-clip.")
    if alg.rollout_is_cap is not None and alg.rollout_is_cap < 1:
        raise ConfigError(f"algorithm.rollout_is_cap={alg.rollout_is_cap} must be >= 1 (e.g. 2.0), or null to "
                          "disable the truncated importance-sampling correction.")
    if alg.kl_ctrl.type == "adaptive" and not alg.use_kl_in_reward:
        raise ConfigError("algorithm.kl_ctrl.type=adaptive steers the in-reward KL penalty, which is off: set "
                          "algorithm.use_kl_in_reward=true, or algorithm.kl_ctrl.type=fixed.")
    if c.enable is None:
        c.enable = alg.adv_estimator in NEEDS_CRITIC
    if alg.adv_estimator in NEEDS_CRITIC and not c.enable:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} needs a critic (value estimates), but "
                          "critic.enable=false: set critic.enable=true, or use a critic-free estimator (grpo, rloo, "
                          "reinforce_plus_plus, reinforce_plus_plus_baseline).")
    if c.enable and alg.adv_estimator not in NEEDS_CRITIC:
        raise ConfigError(f"critic.enable=true, but algorithm.adv_estimator={alg.adv_estimator} uses no values: the "
                          "critic would train for nothing. Use algorithm.adv_estimator=gae, or critic.enable=false.")
    if c.warmup_steps and not c.enable:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} delays the actor for a critic that this run does not "
                          "have (it needs algorithm.adv_estimator=gae); set critic.warmup_steps=0.")
    if c.warmup_steps >= cfg.trainer.total_steps:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} leaves the actor no step of the "
                          f"trainer.total_steps={cfg.trainer.total_steps}; lower it.")
    if cfg.ref.placement == "separate" and not uses_reference(cfg):
        raise ConfigError("ref.placement=separate asks for reference workers, but nothing uses the reference: set "
                          "actor.use_kl_loss=true or algorithm.use_kl_in_reward=true, or ref.placement=colocated.")
    if cfg.ref.placement == "separate" and cfg.model.random_init:
        raise ConfigError("ref.placement=separate loads the reference from model.path's weights, but "
                          "model.random_init=true (the initial policy exists only in the actor's workers); use "
                          "ref.placement=colocated.")
    if c.placement == "separate" and not c.enable:
        raise ConfigError("critic.placement=separate asks for critic workers, but this run has no critic "
                          "(algorithm.adv_estimator is not gae); set critic.placement=colocated.")


PLACEMENTS = ("colocated", "separate")


def _resolve_roles(cfg: Config) -> None:
    """Fill the reference's and critic's unset sizes from the actor's and check their layouts: colocated roles
    share the actor's processes (so its parallel layout); separate ones get their own devices."""
    a, r = cfg.actor, cfg.rollout
    for name, role in (("ref", cfg.ref), ("critic", cfg.critic)):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            mine, actors = getattr(role, key), getattr(a, key)
            if mine is None:
                setattr(role, key, actors)
            elif role.placement == "colocated" and mine != actors:
                raise ConfigError(f"{name}.{key}={mine} differs from actor.{key}={actors}, but {name}.placement="
                                  f"colocated runs the {name} in the actor's processes (its layout). Set "
                                  f"{name}.placement=separate, or remove {name}.{key}.")
            else:
                _positive((f"{name}.{key}", mine))
        if role.micro_batch_size is None:
            role.micro_batch_size = a.micro_batch_size
        _positive((f"{name}.micro_batch_size", role.micro_batch_size))
    c = cfg.critic
    c.model_path = c.model_path or cfg.model.path
    c.ppo_mini_batch_size = c.ppo_mini_batch_size or a.ppo_mini_batch_size
    c.ppo_epochs = c.ppo_epochs or a.ppo_epochs
    _positive(("critic.ppo_mini_batch_size", c.ppo_mini_batch_size), ("critic.ppo_epochs", c.ppo_epochs))
    if cfg.data.train_batch_size % c.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
                          f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size}; make it a multiple.")
    # The reference runs forward over the step's whole batch; the critic trains on mini-batches.
    for name, role, prompts in (("ref", cfg.ref, cfg.data.train_batch_size), ("critic", c, c.ppo_mini_batch_size)):
        if role.placement == "colocated":
            world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        else:
            world = role.nnodes * role.n_gpus_per_node
        model_parallel = role.tensor_model_parallel_size * role.pipeline_model_parallel_size
        if world % model_parallel:
            raise ConfigError(f"{name}: {world} devices ({name}.nnodes x {name}.n_gpus_per_node) are not divisible "
                              f"by {name}.tensor_model_parallel_size x {name}.pipeline_model_parallel_size = "
                              f"{model_parallel}. Choose sizes whose product divides the device count.")
        dp = world // model_parallel
        samples = prompts * r.n
        if samples % (dp * role.micro_batch_size):
            raise ConfigError(f"{name}: a batch of {samples} samples (prompts x rollout.n) does not "
                              f"split into data-parallel size {dp} x {name}.micro_batch_size={role.micro_batch_size}. "
                              f"Change {name}.micro_batch_size or the mini-batch size.")


def _validate_model(hf: dict, role: str, tp: int, pp: int, vpp: int, ep: int, rollout_tp: int, max_model_len: int,
                    length_key: str) -> None:
    """The model against `role`'s layout (actor, or a separate ref / critic) and the engines'."""
    check_model_layout(hf, (f"{role}.tensor_model_parallel_size", tp), (f"{role}.pipeline_model_parallel_size", pp),
                       (f"{role}.expert_model_parallel_size", ep),
                       (f"{role}.virtual_pipeline_model_parallel_size", vpp))
    _check_heads(hf, "rollout.tensor_parallel_size", rollout_tp, MODEL_SOURCE)
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and max_model_len > positions:
        raise ConfigError(f"{length_key} = {max_model_len} exceeds the model's max_position_embeddings="
                          f"{positions} ({MODEL_SOURCE}); lower {length_key}.")


MODEL_SOURCE = "model.path's config.json"


def check_model_layout(hf: dict, tp: tuple[str, int], pp: tuple[str, int], ep: tuple[str, int],
                       vpp: tuple[str, int] | None = None, source: str = MODEL_SOURCE) -> None:
    """A model's config.json (read from `source`) against a parallel layout, before anything is built. Each size
    comes with the name the user set it by (a config key, or a command-line flag), which the ConfigError names."""
    from rl_megatron.models.weight_tables import MOE_FAMILIES, SUPPORTED_FAMILIES, moe_experts

    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if key not in hf:
            raise ConfigError(f"{source} lacks '{key}'; is the model a decoder-only causal LM?")
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "num_key_value_heads"):
        value = hf.get(key)
        if key in hf and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{source} has {key}={value!r}; it must be a positive integer.")
    if hf.get("model_type") not in SUPPORTED_FAMILIES:
        raise ConfigError(f"{source} has model_type={hf.get('model_type')!r}, which is not supported yet; "
                          f"supported: {', '.join(SUPPORTED_FAMILIES)}.")
    _check_heads(hf, *tp, source)
    (pp_name, pp_size), (vpp_name, vpp_size) = pp, vpp or ("", 1)
    if hf["num_hidden_layers"] % (pp_size * vpp_size):
        sizes = f"{pp_name}={pp_size}" + (f" x {vpp_name}={vpp_size}" if vpp_size > 1 else "")
        raise ConfigError(f"{sizes} must divide the model's {hf['num_hidden_layers']} layers ({source}). Choose "
                          "sizes whose product divides the layer count.")
    if hf["model_type"] in MOE_FAMILIES:
        experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
        for key in (experts_key, "num_experts_per_tok", MOE_FAMILIES[hf["model_type"]].width_key):
            value = hf.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source} has {key}={value!r}; an MoE model needs a positive integer there.")
    try:
        experts = moe_experts(hf)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    ep_name, ep_size = ep
    if ep_size > 1 and not experts:
        raise ConfigError(f"{ep_name}={ep_size} needs an MoE model, but {source} has model_type={hf['model_type']!r} "
                          f"(no experts); set {ep_name}=1.")
    if experts % ep_size:
        raise ConfigError(f"{ep_name}={ep_size} must divide the model's {experts} experts ({source}); choose a "
                          "divisor.")


def _check_heads(hf: dict, name: str, size: int, source: str) -> None:
    """A tensor-parallel size must split the attention heads and the key/value heads evenly."""
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    if heads % size or groups % size:
        raise ConfigError(f"{name}={size} must divide the model's attention heads ({heads}) and key/value heads "
                          f"({groups}) ({source}). Choose a size that divides both.")


def _positive(*pairs) -> None:
    for key, value in pairs:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")


def _validate_reward(cfg: Config) -> None:
    """The reward pool's sizes, and that reward.custom_fn imports (here, before any process starts)."""
    rw = cfg.reward
    _positive(("reward.num_workers", rw.num_workers))
    if rw.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s={rw.timeout_s} must be > 0 seconds, e.g. 10.")
    if rw.custom_fn is not None:
        from rl_megatron.rewards.custom import load_custom_fn

        load_custom_fn(rw.custom_fn)  # raises a ConfigError naming reward.custom_fn and what is missing
