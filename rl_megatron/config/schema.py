"""The typed configuration schema. Every key has a default and a one-line description (its comment).

YAML files in configs/ and `key=value` overrides are merged onto these dataclasses; keys that are not
declared here are rejected (see `rl_megatron.config.load`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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


@dataclass
class ModelConfig:
    path: str = "???"  # Hugging Face model folder: config.json, tokenizer files, and *.safetensors weights
    random_init: bool = False  # ignore the folder's weights and initialise randomly from trainer.seed
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
    expert_model_parallel_size: int = 1  # Megatron EP size: an MoE layer's experts split over this many DP ranks
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (each brings rollout.n samples)
    ppo_epochs: int = 1  # passes over each step's samples
    micro_batch_size: int = 4  # samples per forward/backward on one data-parallel rank
    clip_ratio_low: float = 0.2  # PPO clip: ratio is kept above 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip: ratio is kept below 1 + clip_ratio_high
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class RolloutConfig:
    tensor_parallel_size: int = 1  # vLLM engine TP size (engines = actor devices / this)
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling (-1 disables)
    max_tokens: int = 16  # maximum new tokens per sample
    max_model_len: Optional[int] = None  # longest prompt + response (default: data.max_prompt_length + max_tokens)
    kv_cache_bytes: int = 32 * 1024 * 1024  # KV-cache memory per engine on CPU
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine may take


@dataclass
class ReshardingConfig:
    bucket_mb: int = 256  # weights sent between ranks go in buckets of at most this many MiB (a sync's extra memory)
    channel: str = "auto"  # auto (read in place on one CPU host; NCCL on GPU) or buckets: shared_memory, process_group
    verify: bool = False  # after every sync, compare checksums of every piece on both sides (slow; for debugging)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # advantage estimator (grpo)
    norm_adv_by_std: bool = True  # GRPO: divide by the group's reward std (False gives Dr.GRPO)
    loss_agg_mode: str = "token-mean"  # token-mean over the mini-batch's response tokens


@dataclass
class DataConfig:
    task: str = "arithmetic"  # built-in task generated on the fly: arithmetic
    train_batch_size: int = 16  # prompts per RL step
    max_prompt_length: int = 64  # prompts longer than this (in tokens) are dropped


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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    resharding: ReshardingConfig = field(default_factory=ReshardingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ray: RayConfig = field(default_factory=RayConfig)
