"""The config sections of the roles that hold a model other than the trained policy: the frozen reference, the teacher
of on-policy distillation, a reward model, a generative judge. Part of the typed schema (`rl_megatron.config.schema`,
which `Config` assembles), kept apart for its size; the same rules: a default and a comment for every key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rl_megatron.config.fields import POSITIVE, above, at_least, checked, within

Placement = Literal["colocated", "separate"]


@dataclass
class FrozenModelConfig:
    """The keys of a role that only runs forward passes over a frozen model (the reference, the teacher, the reward
    model)."""
    placement: Placement = "colocated"  # colocated: in the actor's workers; separate: its own workers (keys below)
    nnodes: int = checked(1, POSITIVE)  # separate placement: nodes of its pool
    n_gpus_per_node: int = checked(1, POSITIVE)  # separate placement: devices per node of its pool
    tensor_model_parallel_size: Optional[int] = checked(None, POSITIVE)  # separate placement: its TP (default: the actor's)
    pipeline_model_parallel_size: Optional[int] = checked(None, POSITIVE)  # separate placement: its PP (default: the actor's)
    micro_batch_size: Optional[int] = checked(None, POSITIVE)  # samples per forward (default: actor.micro_batch_size)
    max_tokens_per_micro_batch: Optional[int] = checked(None, POSITIVE)  # token budget of a forward micro-batch (default: the actor's)
    param_offload: bool = True  # on GPU, keep the frozen weights in host memory between uses


@dataclass
class RefConfig(FrozenModelConfig):
    """The reference policy of the KL terms: the initial policy."""


@dataclass
class TeacherModelConfig:
    path: Optional[str] = None  # Hugging Face folder of the teacher (config.json, tokenizer, *.safetensors): any supported family and size, with the policy's tokenizer; null: no teacher (no distillation)


@dataclass
class TeacherConfig(FrozenModelConfig):
    """The teacher of on-policy distillation (algorithm.distillation): a frozen model of its own whose log-probs of
    the policy's sampled tokens enter the advantages (docs/algorithms.md)."""
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)  # the teacher's model folder


@dataclass
class RewardModelFolderConfig:
    path: Optional[str] = None  # Hugging Face folder of a sequence classifier with one score (*ForSequenceClassification, num_labels=1, a score.weight head; e.g. Skywork-Reward): any supported family, its own tokenizer and chat template; null: no reward model


@dataclass
class RewardModelConfig(FrozenModelConfig):
    """A reward model: a frozen sequence classifier of its own that scores each (prompt, response), the conversation
    rendered with its own tokenizer's chat template; its score, weighted, enters the reward (docs/tasks-and-rewards.md)."""
    model: RewardModelFolderConfig = field(default_factory=RewardModelFolderConfig)  # the reward model's folder
    coef: float = checked(1.0, above(0))  # weight of its score in the reward: score + coef x the model's score (mixed), or coef x the model's score (alone)
    mode: Literal["mixed", "alone"] = "mixed"  # mixed: added to the rule-based score (reward.*); alone: the model's score is the reward (the rule's score and accuracy are still logged, not trained on)


@dataclass
class JudgeModelConfig:
    path: Optional[str] = None  # Hugging Face folder of a judge of its own (any model vLLM serves, with its own tokenizer and chat template), served by vLLM engines of its own on judge.nnodes x n_gpus_per_node devices; null: the policy's own engines judge


DEFAULT_JUDGE_TEMPLATE = ("Rate the response to the question from 0 (wrong) to 10 (fully correct). Question: {prompt} "
                          "Response: {response} Reply with the score alone.")


@dataclass
class JudgeConfig:
    """A generative judge (GenRM): a model that reads each (prompt, response) and writes a verdict, whose parsed
    score, weighted, enters the reward (docs/tasks-and-rewards.md)."""
    enable: bool = False  # score every training sample with the judge, right after each batch's rollout
    model: JudgeModelConfig = field(default_factory=JudgeModelConfig)  # the judge's own model; null path: the policy's engines judge (a self-judge)
    nnodes: int = checked(1, POSITIVE)  # a judge of its own: nodes of its engines' pool
    n_gpus_per_node: int = checked(1, POSITIVE)  # a judge of its own: devices per node of its engines' pool
    tensor_parallel_size: int = checked(1, POSITIVE)  # a judge of its own: each engine's TP size (engines = its devices / this)
    gpu_memory_utilization: float = checked(0.9, within(0, 1, low_open=True))  # a judge of its own: the share of each GPU its engine takes (weights and KV cache)
    max_model_len: Optional[int] = checked(None, POSITIVE)  # a judge of its own: its engines' longest message + verdict (null: its config.json's max_position_embeddings)
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE  # the judge's user message, with {prompt}, {response} and {ground_truth} (the sample's, as text) filled in, rendered with the tokenizer's chat template (plain text without one)
    parser: Literal["number", "boxed", "json"] = "number"  # how a score is read from the verdict: number (the last number written), boxed (the last \boxed{...}), json (the last JSON object's json_field)
    json_field: str = "score"  # parser=json: the field holding the score
    score_scale: float = checked(10.0, above(0))  # the parsed score is divided by this: 10 puts the default template's 0-10 scale at 0-1 (1 for a template asking 0 or 1)
    failure_score: float = 0.0  # the score of a verdict the parser cannot read (counted in judge/parse_failures)
    max_tokens: int = checked(64, POSITIVE)  # the verdict's token budget
    temperature: float = checked(0.0, at_least(0))  # sampling temperature of the verdicts (0: greedy)
    coef: float = checked(1.0, above(0))  # weight of the judge's score in the reward
    mode: Literal["mixed", "alone"] = "mixed"  # mixed: added to the rule-based score; alone: the judge's score is the reward (the rule's still logged)
