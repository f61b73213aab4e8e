"""Endless, deterministic, resumable batches of tokenized prompts."""
from __future__ import annotations

import torch

from rl_megatron.batch import Prompt


class PromptLoader:
    """Serves batches from a stream of shuffled epochs.

    Epoch e is the permutation drawn from a generator seeded with seed + e, and batches are cut
    from the concatenation of epochs, so an epoch's tail simply continues into the next epoch and
    (epoch, offset) is the whole resumable state. With shuffle=False every epoch is in row order.
    """

    def __init__(self, rows: list[dict], tokenizer, batch_size: int | None, max_prompt_length: int, seed: int, *,
                 use_chat_template: bool = True, shuffle: bool = True, fingerprint: str = "",
                 tools: list[dict] | None = None):
        """`rows` hold "prompt" (a string, or a list of chat messages), "ground_truth", "data_source" and
        optionally "extra_info". batch_size=None serves all (kept) rows in every batch. `fingerprint` names the
        data, so that a saved position is only loaded back over the same data. `tools`: the function schemas the
        chat template presents to the model (multi-turn tool use)."""
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.dropped = 0
        for row, ids in zip(rows, tokenize_prompts([row["prompt"] for row in rows], tokenizer, use_chat_template,
                                                            tools)):
            if len(ids) > max_prompt_length:
                self.dropped += 1
                continue
            self.rows.append(row)
            self.prompt_ids.append(ids)
        if not self.rows:
            raise ValueError(
                f"the dataset has no prompts of at most max_prompt_length={max_prompt_length} tokens "
                f"({len(rows)} rows given, {self.dropped} dropped as too long)"
            )
        self.batch_size = len(self.rows) if batch_size is None else batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = fingerprint
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(len(self.rows), generator=generator).tolist()
            else:
                self._order = list(range(len(self.rows)))
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[Prompt]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            taken = self._epoch_order()[self.offset : self.offset + self.batch_size - len(indices)]
            indices.extend(taken)
            self.offset += len(taken)
            if self.offset == len(self.rows):
                self.epoch += 1
                self.offset = 0
        return self._batch(indices)

    def in_order(self):
        """Every kept row once, in file order, in batches of batch_size (all at once for None): a validation pass.
        Leaves the position of `next_batch` alone."""
        for start in range(0, len(self.rows), self.batch_size):
            yield self._batch(range(start, min(start + self.batch_size, len(self.rows))))

    def _batch(self, indices) -> list[Prompt]:
        return [Prompt(self.prompt_ids[i], self.rows[i]["data_source"], self.rows[i]["ground_truth"],
                       self.rows[i].get("extra_info", {}),
                       self.rows[i]["prompt"] if isinstance(self.rows[i]["prompt"], list) else None)
                for i in indices]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "num_rows": len(self.rows), "seed": self.seed,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        # The position only means the same thing over the same data, filtered the same way, in the same order.
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"loader state was saved over the data {state['fingerprint']!r} but this loader reads "
                f"{self.fingerprint!r}: resume with the same data files, in the same order (or start a new run)"
            )
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"loader state was saved over {state['num_rows']} rows but this dataset has {len(self.rows)} (the "
                "same data filtered differently: resume with the same tokenizer and max_prompt_length)"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']} but this loader's seed is "
                             f"{self.seed}: resume with the same seed")
        self.epoch = state["epoch"]
        self.offset = state["offset"]


def tokenize_prompts(prompts: list, tokenizer, use_chat_template: bool,
                     tools: list[dict] | None = None) -> list[list[int]]:
    """Token ids of each prompt: a string as raw text (with the tokenizer's own special tokens, e.g. BOS); a list
    of chat messages through the tokenizer's chat template (ending in the assistant's turn), or, when
    use_chat_template is false, its messages' contents joined by newlines as raw text."""
    templated = [isinstance(prompt, list) and use_chat_template for prompt in prompts]
    if any(templated) and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the prompts are chat messages but the tokenizer (model.path) has no chat template: set "
                         "data.apply_chat_template=false to use the messages' text as is, or use a model whose "
                         "tokenizer_config.json has a chat_template")
    texts = [
        tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True) if chat
        else prompt if isinstance(prompt, str) else "\n".join(message["content"] for message in prompt)
        for prompt, chat in zip(prompts, templated)
    ]
    ids: list[list[int]] = [[] for _ in prompts]
    # Batched per kind (fast tokenizers encode a batch in parallel); a rendered template already holds its
    # special tokens, so the tokenizer must not add its own (a second BOS) there.
    for kind in (True, False):
        positions = [i for i, chat in enumerate(templated) if chat == kind]
        if positions:
            encoded = tokenizer([texts[i] for i in positions], add_special_tokens=not kind)["input_ids"]
            for i, token_ids in zip(positions, encoded):
                ids[i] = list(token_ids)
    return ids
