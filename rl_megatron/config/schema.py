"""The typed configuration schema. Every key has a default and a one-line description (its comment).

YAML files in configs/ and `key=value` overrides are merged onto these dataclasses; keys that are not
declared here are rejected (see `rl_megatron.config.load`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TrainerConfig:
    experiment_name: str = "default"  # run name; outputs go to <log_dir>/<experiment_name>/
    log_dir: str = "runs"  # parent folder of run directories (tensorboard, metrics.jsonl)
    total_steps: int = 100  # number of RL steps (generate -> score -> update -> sync)
    seed: int = 0  # seeds model init, data order and sampling
    target_reward: Optional[float] = None  # stop early once the mean reward of the last 5 steps reaches this
    nnodes: int = 1  # nodes in the Ray cluster
    n_gpus_per_node: int = 2  # devices per node given to the actor (CPU slots when there is no GPU)
    progress_bar: bool = True  # show a tqdm progress bar on the console
    val_every: int = 0  # validate on the validation split every this many steps, and after the last (0: never)
    val_before_train: bool = False  # validate once before the first step (the starting point of the curves)
    val_generations_to_log: int = 4  # validation samples shown as a text table in tensorboard
    save_every: int = 0  # save a checkpoint every this many steps; 0: only at the end and when stopped (SIGTERM/SIGINT); -1: never
    keep_last: int = 2  # keep the newest this many checkpoints, delete older ones (0 keeps all)
    resume: str = "auto"  # auto: continue from checkpoint_dir's latest good checkpoint if any; off; or a step folder path
    checkpoint_dir: Optional[str] = None  # where checkpoints go (default: <log_dir>/<experiment_name>/checkpoints)
    imports: list[str] = field(default_factory=list)  # your modules (dotted names or .py paths) imported first in the controller, the workers and the scorer processes, e.g. for @rl_megatron.rewards.register


@dataclass
class ModelConfig:
    path: str = "???"  # Hugging Face model folder: config.json, tokenizer files, and *.safetensors weights
    random_init: bool = False  # ignore the folder's weights and initialise randomly from trainer.seed
    checkpoint: Optional[str] = None  # start from this Megatron checkpoint (`python -m rl_megatron.convert from-hf`) instead of path's weights
    dtype: str = "float32"  # parameter dtype: float32 or bfloat16
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocabulary to a multiple of this x TP


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # final learning rate of a decaying schedule
    lr_warmup_steps: int = 0  # linear warm-up, in optimizer steps
    lr_decay_style: str = "constant"  # constant, linear or cosine (over the run's optimizer steps)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # clip the global gradient norm to this (0 disables)


@dataclass
class ActorConfig:
    tensor_model_parallel_size: int = 1  # Megatron TP size of the policy
    pipeline_model_parallel_size: int = 1  # Megatron PP size of the policy
    virtual_pipeline_model_parallel_size: int = 1  # model chunks per PP stage (interleaved schedule; >1 needs PP>1)
    context_parallel_size: int = 1  # Megatron CP size of the policy (only 1 is supported yet)
    expert_model_parallel_size: int = 1  # Megatron EP size: an MoE layer's experts split over this many ranks
    expert_tensor_parallel_size: Optional[int] = None  # each expert's own TP size, at most TP (default: the TP)
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (each brings rollout.n samples)
    ppo_epochs: int = 1  # passes over each step's samples
    micro_batch_size: int = 4  # samples per forward/backward on one data-parallel rank
    clip_ratio_low: float = 0.2  # PPO clip: ratio is kept above 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip: ratio is kept below 1 + clip_ratio_high (DAPO's clip-higher: raise it)
    clip_ratio_c: Optional[float] = None  # dual-clip PPO: a negative-advantage token's loss is capped at -A*c (c > 1)
    loss_agg_mode: str = "token-mean"  # token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # weight of the entropy bonus in the actor loss
    use_kl_loss: bool = False  # add coef * KL(actor || reference) to the actor loss (GRPO's KL term)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # KL estimator of the loss: k1, k2 (mse), k3 (low_var_kl) or abs
    offload: bool = True  # on GPU: Megatron weights/grads/Adam state wait in host memory during generation, vLLM sleeps in training
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class MoeConfig:
    num_experts: Optional[int] = None  # routed experts per layer (default: config.json's); needs model.random_init
    top_k: Optional[int] = None  # experts per token (default: config.json's); needs model.random_init
    aux_loss_coeff: float = 0.0  # load-balancing loss weight (Megatron's aux_loss if > 0; 0: no router objective)
    z_loss_coeff: float = 0.0  # router z-loss weight (ST-MoE: keeps the router logits small); 0 disables
    capacity_factor: Optional[float] = None  # capacity: this x tokens x top_k / experts; more dropped (None: none)
    token_drop_policy: str = "probs"  # over capacity, drop the lowest-probability (probs) or latest (position) tokens
    token_dispatcher: Optional[str] = None  # allgather or alltoall (None: alltoall on GPU, allgather on CPU)
    router_dtype: Optional[str] = None  # fp32 or fp64: the router's logits and probabilities (None: model.dtype)
    freeze_router: bool = False  # keep the routers' weights fixed during training (requires_grad False)
    grouped_gemm: bool = False  # a layer's experts as one grouped GEMM (Transformer Engine's TEGroupedMLP; GPU + TE)


@dataclass
class RefConfig:
    placement: str = "colocated"  # colocated: in the actor's workers; separate: its own workers (keys below)
    nnodes: int = 1  # separate placement: nodes of its pool
    n_gpus_per_node: int = 1  # separate placement: devices per node of its pool
    tensor_model_parallel_size: Optional[int] = None  # separate placement: its TP (default: the actor's)
    pipeline_model_parallel_size: Optional[int] = None  # separate placement: its PP (default: the actor's)
    micro_batch_size: Optional[int] = None  # samples per forward (default: actor.micro_batch_size)
    param_offload: bool = True  # on GPU, keep the frozen weights in host memory between uses


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # train a value model (default: when algorithm.adv_estimator needs one, i.e. gae)
    model_path: Optional[str] = None  # HF folder of the critic's trunk (default: model.path); the value head is new
    placement: str = "colocated"  # colocated: in the actor's workers; separate: its own workers (keys below)
    nnodes: int = 1  # separate placement: nodes of its pool
    n_gpus_per_node: int = 1  # separate placement: devices per node of its pool
    tensor_model_parallel_size: Optional[int] = None  # separate placement: its TP (default: the actor's)
    pipeline_model_parallel_size: Optional[int] = None  # separate placement: its PP (default: the actor's)
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic optimizer step (default: the actor's)
    ppo_epochs: Optional[int] = None  # passes over each step's samples (default: the actor's)
    micro_batch_size: Optional[int] = None  # samples per forward/backward (default: the actor's)
    cliprange_value: float = 0.5  # clipped value loss: predictions kept within this of the rollout-time values
    loss_agg_mode: str = "token-mean"  # aggregation of the value loss (same modes as actor.loss_agg_mode)
    warmup_steps: int = 0  # RL steps that train only the critic before the actor starts updating
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class RolloutConfig:
    function: str = "rl_megatron.rollout.single_turn:generate"  # "pkg.mod:fn" or "file.py:fn" turning prompts into samples: fn(engines, prompts, sampling) -> list[Sample] (see rl_megatron/rollout/single_turn.py)
    placement: str = "colocated"  # colocated: engines in the actor's workers (hybrid engine); separate: their own workers (keys below)
    nnodes: int = 1  # separate placement: nodes of the engines' pool
    n_gpus_per_node: int = 1  # separate placement: devices per node of the engines' pool
    tensor_parallel_size: int = 1  # vLLM engine TP size (engines = the devices hosting them / this)
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling (-1 disables)
    max_tokens: int = 16  # maximum new tokens per sample
    val_n: int = 1  # samples per validation prompt: 1 = greedy; more = sampled at rollout.temperature, with pass@k
    max_model_len: Optional[int] = None  # longest prompt + response (default: data.max_prompt_length + max_tokens)
    kv_cache_bytes: int = 32 * 1024 * 1024  # KV-cache memory per engine on CPU
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine may take


@dataclass
class ReshardingConfig:
    bucket_mb: int = 256  # weights sent between ranks go in buckets of at most this many MiB (a sync's extra memory)
    channel: str = "auto"  # auto (read in place on one CPU host; NCCL on GPU) or buckets: shared_memory, process_group
    verify: bool = False  # after every sync, compare checksums of every piece on both sides (slow; for debugging)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed, or adaptive (the coefficient follows target_kl, Ziegler et al. 2019)
    kl_coef: float = 0.001  # (initial) coefficient of the in-reward KL penalty
    target_kl: float = 0.1  # adaptive: the per-token KL the controller steers to
    horizon: int = 10000  # adaptive: samples over which the coefficient may change by up to 20%


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # gae (needs the critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline
    norm_adv_by_std: bool = True  # grpo: divide by the group's reward std (False gives Dr.GRPO)
    gamma: float = 1.0  # discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards
    kl_penalty: str = "k1"  # KL estimator of the in-reward penalty: k1, k2 (mse), k3 (low_var_kl) or abs
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_is_cap: Optional[float] = None  # truncated IS: weight the policy gradient by min(p_train/p_rollout, cap)


@dataclass
class DataConfig:
    task: Optional[str] = None  # built-in task generated on the fly (default arithmetic); leave unset with train_files
    train_files: Any = field(default_factory=list)  # parquet files in verl's layout (a list, or one path) to train on
    val_files: Any = field(default_factory=list)  # parquet files to validate on (a list, or one path), read in file order
    apply_chat_template: bool = True  # render message-list prompts with the tokenizer's chat template; false: their text as is
    val_batch_size: Optional[int] = None  # prompts per validation batch (None: the whole validation set at once)
    train_batch_size: int = 16  # prompts per RL step
    max_prompt_length: int = 64  # prompts longer than this (in tokens) are dropped


@dataclass
class RewardConfig:
    num_workers: int = 4  # scorer processes; a step's samples are scored in parallel, off the controller
    timeout_s: float = 10.0  # per-sample limit: a scorer past it is killed, scores 0 and counts in reward/timeouts
    custom_fn: Optional[str] = None  # "pkg.mod:fn" or "file.py:fn" scoring all samples: fn(data_source, solution_str, ground_truth, extra_info)


@dataclass
class RayConfig:
    address: Optional[str] = None  # an existing cluster ("auto"); None starts a local Ray
    num_cpus: Optional[int] = None  # CPUs of a local Ray (None: all of this machine's)
    object_store_memory: int = 256 * 1024 * 1024  # object store of a local Ray, in bytes


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    resharding: ReshardingConfig = field(default_factory=ReshardingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ray: RayConfig = field(default_factory=RayConfig)
