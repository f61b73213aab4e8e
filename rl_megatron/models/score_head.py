"""A reward model's folder: a Hugging Face sequence classifier with one score (`*ForSequenceClassification`,
num_labels=1, e.g. Skywork-Reward and most RLHF reward models). Its trunk is the causal LM's (`model.*`, the same
weight table as any family's), its head `score.weight` [1, hidden] (no bias in transformers' classifiers) in place of
`lm_head`. The score of a sequence is the head applied to the final hidden state of its last token, where
transformers reads it (the last token that is not padding).

In Megatron the head is the critic's scalar output layer (`models.gpt.ValueHead`, whole on every TP rank), loaded
from `score.weight`: the reward model is the critic's model, frozen, with a trained head.
"""
from __future__ import annotations

import torch

from rl_megatron.errors import ConfigError

SCORE_WEIGHT = "score.weight"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def score_head_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """The head tensors a reward model's folder must hold: `score.weight`, one row of hidden_size."""
    return {SCORE_WEIGHT: (1, hf["hidden_size"])}


def check_classifier_config(hf: dict, folder: str, key: str) -> None:
    """config.json of a sequence classifier with a single score: its architectures name a *ForSequenceClassification
    class and it has one label. ConfigError naming `key` and the fix otherwise."""
    architectures = hf.get("architectures") or []
    if not any(isinstance(name, str) and name.endswith(CLASSIFIER_SUFFIX) for name in architectures):
        raise ConfigError(
            f"{key}='{folder}' is not a sequence classifier: config.json's architectures are {architectures}, and a "
            f"reward model is a *{CLASSIFIER_SUFFIX} (a score head, score.weight, instead of lm_head). Point {key} at "
            "a reward model's folder (e.g. one saved by transformers' AutoModelForSequenceClassification with "
            "num_labels=1), or use the folder as teacher.model.path / model.path if it is a causal LM.")
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)  # transformers' default is 2 labels
    if labels != 1:
        raise ConfigError(
            f"{key}='{folder}': config.json gives {labels} labels, but a reward model gives one score per sequence "
            "(num_labels=1, id2label of one entry). Use a single-score reward model; a classifier of several "
            "labels is not a reward model.")


def load_score_head(model, read) -> None:
    """Copy the folder's score head (`read(name)` -> tensor, e.g. `models.gpt.SafetensorsReader.get`) into the
    last stage's scalar output layer of `model` (a GPTModel built with a value head): its weight from
    score.weight, its bias zero (transformers' classifiers have none). A stage without the head does nothing."""
    head = getattr(model, "output_layer", None)
    if head is None or not getattr(model, "post_process", False):
        return
    weight = read(SCORE_WEIGHT)
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise ValueError(f"{SCORE_WEIGHT} has shape {tuple(weight.shape)} in the folder but the model's score head "
                         f"is {tuple(head.weight.shape)}")
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
