"""Endless, deterministic, resumable batches of tokenized prompts."""
import torch


class PromptLoader:
    """Serves batches from a stream of shuffled epochs.

    Epoch e is the permutation drawn from a generator seeded with seed + e, and batches are cut
    from the concatenation of epochs, so an epoch's tail simply continues into the next epoch and
    (epoch, offset) is the whole resumable state.
    """

    def __init__(self, rows: list[dict], tokenizer, batch_size: int, max_prompt_length: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.dropped = 0
        for row in rows:
            ids = tokenizer(row["prompt"])["input_ids"]
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
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(len(self.rows), generator=generator).tolist()
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> dict[str, list]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            taken = self._epoch_order()[self.offset : self.offset + self.batch_size - len(indices)]
            indices.extend(taken)
            self.offset += len(taken)
            if self.offset == len(self.rows):
                self.epoch += 1
                self.offset = 0
        return {
            "prompt_ids": [self.prompt_ids[i] for i in indices],
            "ground_truth": [self.rows[i]["ground_truth"] for i in indices],
            "data_source": [self.rows[i]["data_source"] for i in indices],
        }

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # The position only means the same thing over the same (filtered) rows.
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"loader state was saved over {state['num_rows']} rows but this dataset has {len(self.rows)}"
            )
        self.epoch = state["epoch"]
        self.offset = state["offset"]
