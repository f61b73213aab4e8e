"""The typed configuration schema. Every key has a default and a one-line description (its comment, the one that
`python -m rl_megatron.train --help` shows: `rl_megatron.config.describe`).

YAML files in configs/ and `key=value` overrides are merged onto these dataclasses; keys that are not declared here
are rejected (see `rl_megatron.config.load`), but for a registered extension's own keys, in the section named after
it next to the key that names it (`extension_name`: actor.clip_cov.ratio), which its own dataclass declares
(`rl_megatron.config.extensions`). A number's range is declared with `checked(default,
bound, hint)` and a name's choices by its `Literal` type (the fixed lists in `rl_megatron.config.choices`);
`rl_megatron.config.fields` checks both for every key. The schema imports nothing but the config package's own
modules and the standard library, so that any package can import its types.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from rl_megatron.config.choices import CHANNELS, DEFAULT_LOGGERS, KL_ESTIMATORS, LOGGERS, LOSS_AGG_MODES, \
    ASYNC_MODES, LORA_TARGETS, MATCH_MODES, SINGLE_TURN, TASK_NAMES, TOOL_FORMATS
from rl_megatron.config.fields import NOT_NEGATIVE, POSITIVE, above, at_least, checked, extension_name, schema_rules, \
    within
from rl_megatron.config.model_roles import (DEFAULT_JUDGE_TEMPLATE, FrozenModelConfig, JudgeConfig,  # noqa: F401
                                            JudgeModelConfig, Placement, RefConfig, RewardModelConfig,
                                            RewardModelFolderConfig, TeacherConfig, TeacherModelConfig)

DEFAULT_ROLLOUT_FUNCTION = "rl_megatron.rollout.default:generate"
OFF_AT_ZERO = "0 turns it off"


@dataclass
class TrainerConfig:
    experiment_name: str = "default"  # run name; outputs go to <log_dir>/<experiment_name>/
    project_name: str = "rl_megatron"  # the wandb project / MLflow experiment the run belongs to
    log_dir: str = "runs"  # parent folder of run directories (tensorboard, metrics.jsonl) and of the local MLflow store (mlflow.db)
    logger: list[Literal[LOGGERS]] = field(default_factory=lambda: list(DEFAULT_LOGGERS))  # where the run's records go (verl's names): console (progress on the terminal), tensorboard, jsonl (metrics.jsonl), wandb (pip install -e .[wandb]), mlflow (pip install -e .[mlflow])
    total_steps: int = checked(100, POSITIVE)  # number of RL steps (generate -> score -> update -> sync)
    seed: int = 0  # seeds model init, data order and sampling
    deterministic: bool = False  # bitwise-reproducible training on GPU, as Megatron-LM's --deterministic-mode: torch's deterministic algorithms, cuDNN's deterministic kernels, CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and Megatron's deterministic_mode in every worker. Costs speed (ordered scatter/index-add and attention backward, no cuDNN autotuning, ring all-reduce, new memory filled with NaN) and refuses ops without a deterministic kernel (torch names the op); vLLM's sampling is not covered (VLLM_BATCH_INVARIANT=1)
    target_reward: Optional[float] = None  # stop early once the mean reward of the last 5 steps reaches this
    nnodes: int = checked(1, POSITIVE)  # nodes in the Ray cluster
    n_gpus_per_node: int = checked(2, POSITIVE)  # devices per node given to the actor (CPU slots when there is no GPU)
    progress_bar: bool = True  # with console in trainer.logger: a tqdm progress bar (true) or one line per step (false)
    balance_batch: bool = True  # order each step's samples so that the actor's data-parallel ranks get equal token counts in every mini-batch (the mini-batches keep their samples)
    val_every: int = checked(0, NOT_NEGATIVE, OFF_AT_ZERO)  # validate on the validation split every this many steps, and after the last (0: never)
    val_before_train: bool = False  # validate once before the first step (the starting point of the curves)
    val_only: bool = False  # validate once and exit, no training: the weights of the run's latest checkpoint (trainer.resume), else model.checkpoint, else model.path; no optimizer state, reference or critic is built
    val_generations_to_log: int = checked(4, NOT_NEGATIVE, OFF_AT_ZERO)  # validation samples logged as a table (tensorboard text panel, wandb Table, MLflow JSON artifact)
    rollout_data_dir: Optional[str] = None  # write every training step's samples to <dir>/<step>.jsonl (verl's key; relative to the working directory): per sample its decoded prompt and response, the reward trained on and its sources, the advantage, status, policy version (docs/watching-and-debugging.md)
    # save a checkpoint every this many steps; 0: only at the end and when stopped (SIGTERM/SIGINT); -1: never
    save_every: int = checked(0, at_least(-1), "use N > 0 (every N steps), 0 (at the end and when stopped) or -1 (never)")
    keep_last: int = checked(2, NOT_NEGATIVE, OFF_AT_ZERO)  # keep the newest this many checkpoints, delete older ones (0 keeps all)
    resume: str = "auto"  # auto: continue from checkpoint_dir's latest good checkpoint if any; off; or a step folder path
    checkpoint_dir: Optional[str] = None  # where checkpoints go (default: <log_dir>/<experiment_name>/checkpoints)
    rollout_staleness: int = checked(0, NOT_NEGATIVE)  # policy versions the rollout may lag the trainer: 0 synchronous; 1 one-step-off (the engines generate batch k+1 while the trainer trains on batch k); N up to N versions (needs rollout.placement=separate); with async_mode=streaming the bound on every trained token's version (1 when left at 0)
    async_mode: Optional[Literal[ASYNC_MODES]] = None  # sync, one_step_off (whole batches generated ahead, up to rollout_staleness of them) or streaming (prompts admitted as the engines free up, groups trained as they finish, each token within rollout_staleness versions: docs/async.md); null: sync at rollout_staleness 0, one_step_off above
    profile_steps: list[int] = field(default_factory=list)  # steps recorded with torch.profiler, one Chrome trace per worker and phase (generate, log_prob, update, sync) under <run_dir>/profile/step_<step>/; each between 1 and total_steps
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # the ranks, within each worker group, that record trainer.profile_steps (a rank a group lacks records nothing there)
    imports: list[str] = field(default_factory=list)  # your modules (dotted names or .py paths) imported first in the controller, the workers and the scorer processes, e.g. for @rl_megatron.rewards.register

    @property
    def run_dir(self) -> str:
        """Where the run's outputs go: <log_dir>/<experiment_name>."""
        return os.path.join(self.log_dir, self.experiment_name)

    @property
    def profile_dir(self) -> str:
        """Where the traces of trainer.profile_steps go: <run_dir>/profile."""
        return os.path.join(self.run_dir, "profile")


@dataclass
class ModelConfig:
    path: str = "???"  # Hugging Face model folder: config.json, tokenizer files, and *.safetensors weights
    random_init: bool = False  # ignore the folder's weights and initialise randomly from trainer.seed
    checkpoint: Optional[str] = None  # start from this Megatron checkpoint (`python -m rl_megatron.convert from-hf`) instead of path's weights
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype
    make_vocab_size_divisible_by: int = checked(128, POSITIVE)  # Megatron pads the vocabulary to a multiple of this x TP


@dataclass
class OptimConfig:
    lr: float = checked(1e-6, NOT_NEGATIVE)  # peak learning rate
    min_lr: float = checked(0.0, NOT_NEGATIVE)  # final learning rate of a decaying schedule
    lr_warmup_steps: int = checked(0, NOT_NEGATIVE)  # linear warm-up, in optimizer steps
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"  # over the run's optimizer steps
    weight_decay: float = checked(0.0, NOT_NEGATIVE)  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    clip_grad: float = checked(1.0, NOT_NEGATIVE)  # clip the global gradient norm to this (0 disables)
    fused: Optional[bool] = None  # torch's fused AdamW kernel (one pass over every parameter, instead of foreach's several) where Megatron falls back to torch's optimizer (no Transformer Engine or Apex FusedAdam); null: on with CUDA, off on CPU (where it would change the demo's last bits for no gain)


@dataclass
class LoraConfig:
    rank: int = checked(0, NOT_NEGATIVE)  # LoRA rank r (PEFT's r, verl's lora_rank): train rank-r adapters on the frozen policy; 0: off (full fine-tuning)
    alpha: float = checked(16.0, above(0))  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = checked(0.0, within(0, 1))  # dropout on the adapters' input (PEFT's lora_dropout)
    target_modules: list[Literal[LORA_TARGETS]] = field(default_factory=lambda: ["all-linear"])  # the Hugging Face linear modules that get adapters (PEFT's names): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear (all of them, as PEFT's); and lm_head, the output layer, when named (untied embeddings only)
    merge: bool = False  # true: each weight sync sends the adapted layers with the adapters merged (W + alpha/r BA); false: the engines get the base weights once and after each update the adapters alone, loaded as a vLLM LoRA adapter (verl's lora.merge). Merged anyway where vLLM cannot serve the adapters: on lm_head, above rank 512, engines in processes of their own (rollout.placement=separate)
    init: Literal["kaiming", "gaussian"] = "kaiming"  # A's initialisation (PEFT's init_lora_weights: true = kaiming, or gaussian); B starts at zero, so the adapted model starts as the base


@dataclass
class ActorConfig:
    tensor_model_parallel_size: int = checked(1, POSITIVE)  # Megatron TP size of the policy
    pipeline_model_parallel_size: int = checked(1, POSITIVE)  # Megatron PP size of the policy
    virtual_pipeline_model_parallel_size: int = checked(1, POSITIVE)  # model chunks per PP stage (interleaved schedule; >1 needs PP>1)
    num_layers_in_first_pipeline_stage: Optional[int] = checked(None, POSITIVE)  # decoder layers on the first PP stage, the other stages sharing the rest evenly (None: an even share; e.g. fewer where the embedding also sits); needs PP>1
    num_layers_in_last_pipeline_stage: Optional[int] = checked(None, POSITIVE)  # decoder layers on the last PP stage (None: an even share; e.g. DeepSeek-V3's 61 layers at PP=16: 1 here, 4 on each other stage); needs PP>1
    context_parallel_size: int = checked(1, POSITIVE)  # Megatron CP size of the policy: each sequence split over this many ranks (> 1 needs actor.sequence_packing and Transformer Engine on a CUDA device)
    expert_model_parallel_size: int = checked(1, POSITIVE)  # Megatron EP size: an MoE layer's experts split over this many ranks
    expert_tensor_parallel_size: Optional[int] = checked(None, POSITIVE)  # each expert's own TP size, at most TP (default: the TP)
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"  # MoE routing replay (verl's names): R2 = the update's forward and backward route each token through the experts the old log-prob pass chose; R3 = the old log-prob, reference and update passes route each token through the experts the rollout engine chose (needs moe.engine_routing); MoE models, at any TP, PP, CP and EP
    ppo_mini_batch_size: int = checked(16, POSITIVE)  # prompts per optimizer step (each brings rollout.n samples)
    ppo_epochs: int = checked(1, POSITIVE)  # passes over each step's samples
    micro_batch_size: int = checked(4, POSITIVE)  # samples per forward/backward on one data-parallel rank (without a token budget)
    max_tokens_per_micro_batch: Optional[int] = checked(None, POSITIVE)  # token budget of a micro-batch on one rank: its samples are binned so their tokens stay within it (a longer sample runs alone); None: micro_batch_size samples each
    sequence_packing: bool = True  # the samples of a micro-batch share one row with attention confined to each (exact, no padding); false: one right-padded row per sample. Every Megatron pass follows it
    fused_log_probs: Optional[bool] = None  # the log-probs' and entropy's work on each chunk of logits in one compiled kernel (torch.compile, dynamic shapes: the logits read once, not a pass per cast, shift, exponential and sum), forward and backward; null: on with CUDA, off on CPU (a compile per process, for no gain at the demo's size); every role follows it
    gradient_accumulation_fusion: Optional[bool] = None  # Megatron's name: each linear layer's weight-gradient GEMM accumulates straight into the fp32 main grad (cuBLAS fp32 output from bf16 inputs), instead of a bf16 gradient that DDP then adds; Apex's kernel where it imports, else a torch one (platform/wgrad_accumulation.py); null: on with CUDA, off on CPU; the roles that train follow it
    fused_swiglu: Optional[bool] = None  # Megatron's SwiGLU fusion (bias_activation_fusion: the gated MLP's activation in one compiled kernel, its input the only tensor kept for the backward) where the MLPs are SwiGLU; null: on with CUDA, off on CPU (a compiled kernel per process, for no gain at the demo's size); every role follows it
    sequence_parallel: Optional[bool] = None  # Megatron sequence parallelism: activations outside the TP regions split over the TP ranks (None: on at TP > 1 on GPU, and on CPU where the model needs it: MoE, Gated DeltaNet; always off at TP 1, where there is nothing to split); the reference and critic follow it at their own TP
    recompute_granularity: Optional[Literal["full", "selective"]] = None  # activation recomputation in the backward: whole layers (full, with recompute_method and recompute_num_layers) or the attention core (selective, alone); None: off
    recompute_method: Optional[Literal["uniform", "block"]] = None  # full recompute: checkpoint groups of recompute_num_layers layers (uniform), or recompute the first recompute_num_layers layers of each model chunk (block; a chunk is a pipeline stage without VPP)
    recompute_num_layers: Optional[int] = checked(None, POSITIVE)  # full recompute: layers per group (uniform; must divide the layers of a model chunk) or per model chunk (block)
    policy_loss: str = extension_name("ppo")  # the registered policy loss: ppo (clipped surrogate, dual-clip with clip_ratio_c), gspo (sequence-level ratio), cispo (clipped IS weight, stop-gradient), clip_cov, kl_cov (covariance-selected tokens), or yours (@rl_megatron.algorithms.register_policy_loss in a module of trainer.imports); a loss's own keys are in the section named after it (actor.clip_cov.ratio)
    clip_ratio_low: float = checked(0.2, NOT_NEGATIVE)  # PPO clip: ratio is kept above 1 - clip_ratio_low
    clip_ratio_high: float = checked(0.2, NOT_NEGATIVE)  # PPO clip: ratio is kept below 1 + clip_ratio_high (DAPO's clip-higher: raise it)
    clip_ratio_c: Optional[float] = checked(None, above(1), "dual-clip's bound, e.g. 3.0, or null to disable dual-clip")  # dual-clip PPO: a negative-advantage token's loss is capped at -A*c (c > 1)
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # how token losses sum up to the mini-batch loss
    entropy_coeff: float = checked(0.0, NOT_NEGATIVE)  # weight of the entropy bonus in the actor loss
    use_kl_loss: bool = False  # add coef * KL(actor || reference) to the actor loss (GRPO's KL term)
    kl_loss_coef: float = checked(0.001, NOT_NEGATIVE)  # weight of the KL loss
    kl_loss_type: Literal[KL_ESTIMATORS] = "low_var_kl"  # KL estimator of the loss: k1, k2 (mse), k3 (low_var_kl) or abs
    offload: bool = True  # on GPU: Megatron weights/grads/Adam state wait in host memory during generation, vLLM sleeps in training
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class MoeConfig:
    num_experts: Optional[int] = checked(None, POSITIVE)  # routed experts per layer (default: config.json's); needs model.random_init
    top_k: Optional[int] = checked(None, POSITIVE)  # experts per token (default: config.json's); needs model.random_init
    aux_loss_coeff: float = checked(0.0, NOT_NEGATIVE, OFF_AT_ZERO)  # load-balancing loss weight (Megatron's aux_loss if > 0; 0: no router objective)
    z_loss_coeff: float = checked(0.0, NOT_NEGATIVE, OFF_AT_ZERO)  # router z-loss weight (ST-MoE: keeps the router logits small); 0 disables
    capacity_factor: Optional[float] = checked(None, above(0), "e.g. 1.25, or null to drop no tokens")  # capacity: this x tokens x top_k / experts; more dropped (None: none)
    token_drop_policy: Literal["probs", "position"] = "probs"  # over capacity, drop the lowest-probability (probs) or latest (position) tokens
    token_dispatcher: Optional[Literal["allgather", "alltoall"]] = None  # (None: alltoall on GPU, allgather on CPU)
    router_dtype: Optional[Literal["fp32", "fp64"]] = None  # the router's logits and probabilities (None: model.dtype)
    freeze_router: bool = False  # keep the routers' weights fixed during training (requires_grad False)
    router_bias_update_rate: float = checked(0.0, NOT_NEGATIVE)  # routers with an expert bias (DeepSeek-V3, GLM-4.5: aux-loss-free balancing): its step per optimizer step towards even loads (DeepSeek's pretraining: 1e-3; 0: the bias stays as loaded)
    grouped_gemm: bool = False  # a layer's experts as one grouped GEMM (Transformer Engine's TEGroupedMLP; GPU + TE)
    engine_routing: Optional[bool] = None  # the rollout engine returns each token's experts (what actor.router_replay=R3 replays; gives moe/routing_agreement every step); None: on for MoE models


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # train a value model (default: when algorithm.adv_estimator needs one, i.e. gae)
    model_path: Optional[str] = None  # HF folder of the critic's trunk (default: model.path); the value head is new
    placement: Placement = "colocated"  # colocated: in the actor's workers; separate: its own workers (keys below)
    nnodes: int = checked(1, POSITIVE)  # separate placement: nodes of its pool
    n_gpus_per_node: int = checked(1, POSITIVE)  # separate placement: devices per node of its pool
    tensor_model_parallel_size: Optional[int] = checked(None, POSITIVE)  # separate placement: its TP (default: the actor's)
    pipeline_model_parallel_size: Optional[int] = checked(None, POSITIVE)  # separate placement: its PP (default: the actor's)
    ppo_mini_batch_size: Optional[int] = checked(None, POSITIVE)  # prompts per critic optimizer step (default: the actor's)
    ppo_epochs: Optional[int] = checked(None, POSITIVE)  # passes over each step's samples (default: the actor's)
    micro_batch_size: Optional[int] = checked(None, POSITIVE)  # samples per forward/backward (default: the actor's)
    max_tokens_per_micro_batch: Optional[int] = checked(None, POSITIVE)  # token budget of a micro-batch (default: the actor's)
    recompute_granularity: Optional[Literal["full", "selective"]] = None  # as actor.recompute_granularity (default: the actor's three recompute keys, unless the critic sets one of them)
    recompute_method: Optional[Literal["uniform", "block"]] = None  # (default: the actor's, as above)
    recompute_num_layers: Optional[int] = checked(None, POSITIVE)  # (default: the actor's, as above)
    cliprange_value: float = checked(0.5, NOT_NEGATIVE)  # clipped value loss: predictions kept within this of the rollout-time values
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # aggregation of the value loss (same modes as actor.loss_agg_mode)
    warmup_steps: int = checked(0, NOT_NEGATIVE)  # RL steps that train only the critic before the actor starts updating
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class MultiTurnConfig:
    tool_config_path: Optional[str] = None  # the tools the model may call: a YAML/JSON file in verl's layout (each tool's class_name, config and OpenAI function schema; see configs/tools/)
    format: Literal[TOOL_FORMATS] = "auto"  # how the model writes tool calls and reads their replies: hermes (Qwen2.5/Qwen3's <tool_call>{"name": ..., "arguments": ...}</tool_call>), harmony (gpt-oss: a message to=functions.NAME, the reward reading the final channel), or auto (harmony when the chat template writes <|channel|>, else hermes)
    max_assistant_turns: int = checked(5, POSITIVE)  # the model's turns in a trajectory; one that would need another ends as truncated
    max_tool_calls: int = checked(8, POSITIVE)  # tool calls in a trajectory (malformed ones count); a turn that would pass it ends the trajectory as truncated
    max_response_length: Optional[int] = checked(None, POSITIVE)  # every token after the prompt (the model's, the tools' and the template's); a trajectory that would pass it ends as truncated (default: max_assistant_turns x (rollout.max_tokens + max_tool_response_length))
    max_tool_response_length: int = checked(256, POSITIVE)  # a tool reply's tokens kept (the rest cut, marked as cut)
    tool_timeout_s: float = checked(30.0, above(0), "seconds, e.g. 30")  # wall-clock limit of one tool call; past it the model is told, and it counts in tool/timeouts
    turn_synchronous: bool = False  # decode every trajectory's turn k as one batch before any turn k + 1 (the slower baseline; for comparison)


@dataclass
class AgentConfig:
    function: Optional[str] = None  # "pkg.mod:fn" or "file.py:fn": your agent, `async def fn(base_url, row) -> float | dict`, run once per episode against the OpenAI-compatible gateway at base_url (docs/agentic-rl.md); null: no gateway
    max_concurrency: int = checked(64, POSITIVE)  # episodes running at once
    num_workers: int = checked(4, NOT_NEGATIVE, "0 runs the episodes in the controller")  # processes running the function's episodes (verl's agent-loop workers), each with its own event loop: the harness's CPU (the `openai` client's, most of a call's cost) beside the gateway's instead of on its event loop; 0: in the controller's event loop (state shared with the caller, breakpoints)
    timeout_s: float = checked(600.0, above(0), "seconds, e.g. 600")  # wall-clock limit of one episode; past it the episode fails (agent/episodes_failed)
    reward: Literal["function", "scorer"] = "function"  # where an episode's reward comes from: the function's return value (a number, or a dict with "reward" and metrics logged under agent/), or the scorer (reward.custom_fn, else the data source's scorer) reading the last assistant message
    failed_reward: Optional[float] = None  # the reward of an episode whose agent raised, timed out or returned garbage, its tokens so far trained; null: the episode joins no loss
    host: str = "127.0.0.1"  # the address the gateway binds: the controller's loopback, where agents run on the controller's machine (its agent workers); the controller's cluster address for harnesses on other machines (never all interfaces by default)
    port: int = checked(0, NOT_NEGATIVE, "0 picks a free port")  # the gateway's port (0: a free one)


@dataclass
class RolloutConfig:
    function: str = DEFAULT_ROLLOUT_FUNCTION  # "pkg.mod:fn" or "file.py:fn" turning prompts into samples: fn(engines, prompts, sampling) -> list[Sample] (see rl_megatron/rollout/default.py)
    agent_loop: str = SINGLE_TURN  # single_turn (each prompt answered in one generation), tool_agent (multi-turn with the tools of multi_turn.tool_config_path), or "pkg.mod:Class" (an rl_megatron.agents.AgentLoop)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # limits and tools of multi-turn agent loops
    agent: AgentConfig = field(default_factory=AgentConfig)  # your own agent harness, served through the OpenAI-compatible gateway
    engine: str = "vllm"  # the rollout engine: a name registered in rl_megatron/rollout/engine.py::ENGINES (vllm)
    placement: Placement = "colocated"  # colocated: engines in the actor's workers (hybrid engine); separate: their own workers (keys below)
    nnodes: int = checked(1, POSITIVE)  # separate placement: nodes of the engines' pool
    n_gpus_per_node: int = checked(1, POSITIVE)  # separate placement: devices per node of the engines' pool
    tensor_parallel_size: int = checked(1, POSITIVE)  # vLLM engine TP size (engines = the devices hosting them / this)
    n: int = checked(8, POSITIVE)  # samples per prompt (the GRPO group size)
    temperature: float = checked(1.0, above(0), "RL needs sampling; use 1.0")  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = checked(1.0, within(0, 1, low_open=True), "use 1.0 to disable nucleus sampling")  # nucleus sampling
    top_k: int = checked(-1, at_least(1, also=(-1,)), "-1 disables top-k sampling")
    max_tokens: int = checked(16, POSITIVE)  # maximum new tokens per sample (per model turn with a multi-turn agent loop)
    ignore_eos: bool = False  # generate max_tokens tokens every time, past the end-of-sequence tokens (vLLM's and verl's ignore_eos): fixed-length samples for benchmarks and tests
    val_n: int = checked(1, POSITIVE)  # samples per validation prompt: 1 = greedy; more = sampled at rollout.temperature, with pass@k
    max_model_len: Optional[int] = checked(None, POSITIVE)  # longest prompt + response (default: data.max_prompt_length + max_tokens, or + multi_turn.max_response_length with an agent loop)
    partial_rollout: bool = False  # with trainer.rollout_staleness > 0: when new weights arrive mid-generation, the engines pause, load them and continue the unfinished samples (each token keeps the version and log-prob it was sampled with) instead of finishing them with the old weights first
    partial_rollout_sync_at_tokens: Optional[int] = checked(None, POSITIVE, "null: as soon as the update is ready")  # with partial_rollout: the weight update lands in every request at exactly this many tokens (the engines wait for it there), so that which weights sample which token is the same in every run, at some cost in speed; null: it lands at the engines' next pause after it is ready (fastest, timing-dependent)
    kv_cache_bytes: int = checked(32 * 1024 * 1024, POSITIVE)  # KV-cache memory per engine on CPU
    gpu_memory_utilization: Optional[float] = checked(None, within(0, 1, low_open=True), "e.g. 0.5")  # fraction of GPU memory the engine may take (default: 0.5 colocated, where the trainer shares the GPU; 0.9, vLLM's own default, on GPUs of its own)


@dataclass
class ReshardingConfig:
    bucket_mb: int = checked(256, POSITIVE)  # weights sent between ranks go in buckets of at most this many MiB (a sync's extra memory)
    channel: Literal[CHANNELS] = "auto"  # auto (read in place on one CPU host; NCCL on GPU) or buckets: process_group, shared_memory (CPU only: refused on GPUs, whose NCCL ignores the tags its signals need)
    verify: bool = False  # after every sync, compare checksums of every piece on both sides (slow; for debugging)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"  # fixed, or adaptive (the coefficient follows target_kl, Ziegler et al. 2019)
    kl_coef: float = checked(0.001, NOT_NEGATIVE)  # (initial) coefficient of the in-reward KL penalty
    target_kl: float = checked(0.1, above(0))  # adaptive: the per-token KL the controller steers to
    horizon: int = checked(10000, POSITIVE)  # adaptive: samples over which the coefficient may change by up to 20%


@dataclass
class RolloutCorrectionConfig:
    level: Optional[Literal["token", "sequence"]] = None  # the ratio p_train / p_rollout per token, or per sequence (the product over its tokens); null: no correction
    mode: Literal["truncate", "mask"] = "truncate"  # truncate (TIS): the policy gradient weighted by min(ratio, threshold); mask (MIS): weighted by the ratio where it is at most threshold, tokens (or sequences) past it excluded
    threshold: float = checked(2.0, at_least(1), "e.g. 2.0")  # the cap (truncate) or the limit (mask) of the ratio
    # verl's bypass mode: the PPO ratio is p_new / p_rollout, the clipped trust region anchored on the policy that
    # sampled (the trainer's recomputed log-probs still give the metrics); null (the default): on where the rollout
    # may lag the trainer (trainer.rollout_staleness > 0) and no level is set, off otherwise (docs/async.md)
    bypass_mode: Optional[bool] = None


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO's dynamic sampling: drop the prompt groups whose samples all score the same (no GRPO signal) and generate more (data.gen_batch_size prompts at a time) until data.train_batch_size groups are kept
    metric: Literal["acc", "score"] = "acc"  # what must vary within a kept group: acc (the scorer's accuracy: its "acc" entry, else its score before any shaping) or score (the shaped reward; a length penalty makes almost every group vary)
    max_num_gen_batches: int = checked(10, NOT_NEGATIVE, "0 means no limit")  # generation rounds a step may use before on_cap applies (0: no limit)
    on_cap: Literal["train", "stop"] = "train"  # at max_num_gen_batches with too few groups kept: train on them (padded to whole mini-batches with dropped groups kept out of the loss), or stop the run with an error


@dataclass
class DistillationConfig:
    coef: float = checked(1.0, above(0))  # weight of the distillation term: coef x (log p_teacher - log p_policy) per response token, log p_policy the old log-probs (Thinking Machines' on-policy distillation: a per-token reverse KL, undiscounted); needs teacher.model.path
    mode: Literal["mixed", "alone"] = "mixed"  # mixed: the term added to the task's advantages (algorithm.adv_estimator's); alone: the term is the whole advantage (the rewards are still scored and logged, not trained on)
    top_k: Optional[int] = checked(None, at_least(1), "e.g. 64, or null to distil through the sampled tokens")  # the teacher's k likeliest tokens at each response position, learnt as a loss term: coef x KL(teacher || policy) over them (NeMo-RL's top-k distillation), in place of the sampled-token advantage; null: Thinking Machines' sampled-token term


@dataclass
class AlgorithmConfig:
    adv_estimator: str = extension_name("grpo")  # the registered advantage estimator: gae (needs the critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, or yours (@rl_megatron.algorithms.register_adv_estimator in a module of trainer.imports); an estimator's own keys are in the section named after it (algorithm.<name>.<key>)
    norm_adv_by_std: bool = True  # grpo: divide by the group's reward std (False gives Dr.GRPO)
    gamma: float = checked(1.0, within(0, 1))  # discount (gae, reinforce_plus_plus)
    lam: float = checked(1.0, within(0, 1))  # GAE lambda
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards
    kl_penalty: Literal[KL_ESTIMATORS] = "k1"  # KL estimator of the in-reward penalty: k1, k2 (mse), k3 (low_var_kl) or abs
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # dynamic sampling (DAPO)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # on-policy distillation from the teacher (teacher.model.path)
    # off-policy correction of the policy loss by the trainer/rollout ratio (staleness, engine/trainer mismatch)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # shorthand for rollout_correction level=token, mode=truncate, threshold=this (truncated IS)
    rollout_is_cap: Optional[float] = checked(
        None, at_least(1), "e.g. 2.0, or null to disable the truncated importance-sampling correction")


@dataclass
class DataConfig:
    task: Optional[Literal[TASK_NAMES]] = checked(
        None, hint="or train on parquet files with data.train_files=[...]")  # built-in task generated on the fly (default arithmetic); leave unset with train_files
    train_files: Any = field(default_factory=list)  # parquet files in verl's layout (a list, or one path) to train on
    val_files: Any = field(default_factory=list)  # parquet files to validate on (a list, or one path), read in file order
    apply_chat_template: bool = True  # render message-list prompts with the tokenizer's chat template; false: their text as is
    val_batch_size: Optional[int] = checked(
        None, POSITIVE, "or null for the whole validation set at once")  # prompts per validation batch (None: the whole validation set at once)
    train_batch_size: int = checked(16, POSITIVE)  # prompts per RL step
    gen_batch_size: Optional[int] = checked(None, POSITIVE)  # prompts generated at a time with algorithm.filter_groups.enable (default: train_batch_size); DAPO draws more than it trains on, e.g. 3x
    max_prompt_length: int = checked(64, POSITIVE)  # prompts longer than this (in tokens) are dropped


@dataclass
class OverlongBufferConfig:
    enable: bool = False  # DAPO's overlong reward shaping (soft overlong punishment): a response that runs into the last `len` tokens before rollout.max_tokens loses reward, linearly up to penalty_factor at rollout.max_tokens
    len: int = checked(4096, POSITIVE)  # tokens before rollout.max_tokens over which the penalty grows from 0 (DAPO: 4096 of a 20480-token response); must be below rollout.max_tokens
    penalty_factor: float = checked(1.0, NOT_NEGATIVE)  # the penalty at rollout.max_tokens and beyond (a multi-turn trajectory's model tokens over all its turns can pass it)


@dataclass
class RewardConfig:
    num_workers: int = checked(4, POSITIVE)  # scorer processes; a step's samples are scored in parallel, off the controller
    timeout_s: float = checked(10.0, above(0), "seconds, e.g. 10")  # per-sample limit: a scorer past it is killed, scores 0 and counts in reward/timeouts
    custom_fn: Optional[str] = None  # "pkg.mod:fn" or "file.py:fn" scoring all samples: fn(data_source, solution_str, ground_truth, extra_info)
    gsm8k_match: Literal[MATCH_MODES] = "exact"  # openai/gsm8k: exact (verl's scores: "#### 72", text equal to the ground truth) or numeric (also "####72", "#### $72"; equal values: "72.00" = "72")
    math_match: Literal[MATCH_MODES] = "exact"  # MATH sources: exact (verl's default_compute_score; data_source math is DAPO's 1/-1 "Answer:" scorer) or numeric (lenient \boxed{} equivalence, 0.5 = \frac{1}{2})
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO's length penalty, added to the scores (not to the accuracy)


@dataclass
class RayConfig:
    address: Optional[str] = None  # an existing cluster ("auto", "host:port"); None starts a local Ray
    connect_timeout_s: float = checked(60.0, above(0), "seconds, e.g. 60")  # how long to wait for ray.address's head to answer before giving up
    num_cpus: Optional[int] = checked(None, POSITIVE)  # CPUs of a local Ray (None: all of this machine's)
    object_store_memory: int = checked(256 * 1024 * 1024, POSITIVE)  # object store of a local Ray, in bytes


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    resharding: ReshardingConfig = field(default_factory=ReshardingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    # the registered extensions' own keys (a loss's, an estimator's) by dotted key, as set in the YAML or overrides
    # (actor.clip_cov.ratio); `rl_megatron.config.extensions` checks them, and fills in their defaults
    extension_keys: dict[str, Any] = field(default_factory=dict)


RULES = schema_rules(Config)  # every key's range and choices, by dotted key
