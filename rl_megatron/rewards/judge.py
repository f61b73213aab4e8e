"""A generative judge's text (judge.*): the message it reads, its tokens, and the score in the verdict it writes;
the trainer's side (rendering for the engines, generating the verdicts) is `rl_megatron/trainer/judge.py`.

The message is judge.prompt_template with {prompt}, {response} and {ground_truth} filled in, each as text (a chat
prompt's question is its last user message). Any other brace pair is the template's own text; "{{" and "}}" write
single braces, as Python's str.format does.

A verdict's score, by judge.parser:
- number: the last number written ("8", "Score: 7.5/10" reads 10: write the scale into the template's instructions,
  or ask for the score alone), signs and decimals kept;
- boxed: the argument of the last \\boxed{...} (MATH's extraction, `rewards/math.py`), a number;
- json: the last JSON object in the verdict holding judge.json_field as a number.
None where the verdict holds no such score: the trainer gives it judge.failure_score and counts it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import string

from rl_megatron.config.schema import Config, RolloutConfig
from rl_megatron.rewards.math import last_boxed_answer

FIELDS = ("prompt", "response", "ground_truth")
JUDGE_PATH_KEY = "judge.model.path"
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def judge_engine_settings(cfg: Config, judge_hf: dict) -> RolloutConfig:
    """How a judge of its own (judge.model.path, config.json `judge_hf`) runs its engines: the policy's engine
    settings (sampling filters, CPU KV cache, ...) at the judge's TP, memory share and lengths, never asleep between
    phases (devices of its own), without partial rollouts or adapters. Its length: judge.max_model_len, else its
    config.json's max_position_embeddings."""
    judge = cfg.judge
    return dataclasses.replace(cfg.rollout, placement="separate", nnodes=judge.nnodes,
                               n_gpus_per_node=judge.n_gpus_per_node, tensor_parallel_size=judge.tensor_parallel_size,
                               gpu_memory_utilization=judge.gpu_memory_utilization, max_tokens=judge.max_tokens,
                               max_model_len=judge.max_model_len or judge_hf["max_position_embeddings"],
                               partial_rollout=False)


def template_fields(template: str) -> set[str]:
    """The {field} names `template` uses (str.format's parse: "{{" is a literal brace)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def judge_message(template: str, prompt: str, response: str, ground_truth) -> str:
    """The judge's user message: `template` with the sample's prompt, response and ground truth (str of it; empty
    when it has none) filled in."""
    return template.format(prompt=prompt, response=response, ground_truth="" if ground_truth is None else ground_truth)


def encode_message(tokenizer, message: str) -> list[int]:
    """The message as the engines read it: through the tokenizer's chat template as a user turn (the assistant's turn
    opened), as plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return tokenizer(message)["input_ids"]


def parse_verdict(verdict: str, parser: str, json_field: str = "score") -> float | None:
    """The score in `verdict` by `parser` (module docstring); None when it holds none (or not a finite number)."""
    if parser == "number":
        numbers = NUMBER.findall(verdict)
        return _finite(numbers[-1]) if numbers else None
    if parser == "boxed":
        boxed = last_boxed_answer(verdict)
        return None if boxed is None else _finite(boxed.strip())
    if parser == "json":
        return _last_json_field(verdict, json_field)
    raise ValueError(f"unknown judge parser {parser!r}")


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _last_json_field(verdict: str, field: str) -> float | None:
    """`field` of the last JSON object in `verdict` that holds it as a number (bools are not numbers)."""
    decoder = json.JSONDecoder()
    found = None
    for start in (i for i, char in enumerate(verdict) if char == "{"):
        try:
            value, _ = decoder.raw_decode(verdict, start)
        except ValueError:
            continue
        score = value.get(field) if isinstance(value, dict) else None
        if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
            found = float(score)
    return found
