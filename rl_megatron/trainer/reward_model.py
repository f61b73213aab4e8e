"""A reward model's scores of a step's samples (reward_model.model.path): each (prompt, response) rendered as the
reward model reads it, scored by its Megatron forward pass on the workers, the score taken at each sequence's last
token as transformers' AutoModelForSequenceClassification takes it.

The scored conversation is rendered with the reward model's own tokenizer and chat template (it may be another
family than the policy, as verl's and OpenRLHF's reward models are): the prompt's chat messages, then the response
decoded from the policy's tokens as the assistant's message; a multi-turn sample's whole conversation as its agent
loop recorded it. A prompt that is plain text (no messages), or a reward model without a chat template, is scored on
the text: the prompt and the response decoded, then encoded by the reward model's tokenizer (its special tokens, e.g.
a leading BOS, added as its tokenizer adds them).

Why Megatron and not vLLM's pooling runner: the reward model then runs in the workers' own processes at any TP/PP,
frozen and offloaded between its passes like the reference and the teacher (one memory plan, no engine of its own to
start, sleep and wake beside the policy's), and its forward equals the critic's, already held to transformers. The
pooling runner would be the faster choice for a large reward model on its own GPUs; the scores would be the same.

Where groups are scored while they generate (dynamic sampling's rounds, streaming's groups), a reward model on workers
of its own (reward_model.placement=separate) scores each round or group then, as the rule does, so that the filter
and the queue read the rewards trained on; in the actor's workers it scores in the step's forward passes only (the
pre-flight check refuses it beside those modes).
"""
from __future__ import annotations

import threading

import torch

from rl_megatron.batch import Sample, TrainBatch, pad_token_id
from rl_megatron.config.pools import scored_while_generating
from rl_megatron.config.schema import Config
from rl_megatron.errors import ConfigError
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.trainer.rewards import ModelScores
from rl_megatron.workers.worker_group import WorkerGroup

KEY = "reward_model.model.path"


class RewardModelScorer:
    """Renders samples for the reward model (its tokenizer loaded once, at the trainer's start) and scores them."""

    def __init__(self, cfg: Config, policy_tokenizer):
        self.settings = cfg.reward_model
        self.path = cfg.reward_model.model.path
        self.tokenizer = load_tokenizer(self.path, KEY)
        self.policy_tokenizer = policy_tokenizer
        self.pad_id = pad_token_id(self.tokenizer)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        # Scores each round or group as it generates (the trainer's score_now), not in the step's forward passes.
        self.while_generating = bool(scored_while_generating(cfg))
        # Streaming scores groups in threads of their own: one call on the workers at a time, so that every rank runs
        # the calls (and their collectives) in the same order.
        self.calls = threading.Lock()

    def conversation(self, sample: Sample) -> list[dict] | None:
        """The messages the reward model's chat template renders; None where the sample is scored as text."""
        if not self.chat:
            return None
        if sample.messages is not None:  # a multi-turn trajectory: the conversation its loop recorded
            return sample.messages
        if sample.prompt_messages is None:
            return None
        response = self.policy_tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return [*sample.prompt_messages, {"role": "assistant", "content": response}]

    def encode(self, sample: Sample) -> list[int]:
        """The token ids the reward model scores for `sample`."""
        messages = self.conversation(sample)
        if messages is not None:
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        text = (self.policy_tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
                + self.policy_tokenizer.decode(sample.response_ids, skip_special_tokens=True))
        ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise ConfigError(f"{KEY}='{self.path}': its tokenizer encodes the sample {text!r} to no tokens; a reward "
                              "model needs a tokenizer that encodes the policy's text.")
        return ids

    def batch(self, samples: list[Sample]) -> TrainBatch:
        """The reward model's rows: each sample's ids right-padded, the score position (its last token) marked in
        the response mask."""
        encoded = [self.encode(sample) for sample in samples]
        lengths = torch.tensor([len(ids) for ids in encoded])
        input_ids = torch.full((len(encoded), int(lengths.max())), self.pad_id, dtype=torch.long)
        mask = torch.zeros(input_ids.shape)
        for row, ids in enumerate(encoded):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            mask[row, len(ids) - 1] = 1.0
        return TrainBatch(input_ids, mask, self.pad_id, lengths)

    def scores(self, group: WorkerGroup, samples: list[Sample]) -> ModelScores:
        """The reward model's score of each sample."""
        batch = self.batch(samples)
        with self.calls:
            values = group.reward_model_scores(batch).values
        return ModelScores("reward_model", values[torch.arange(len(samples)), batch.lengths - 1].float(),
                           self.settings)
