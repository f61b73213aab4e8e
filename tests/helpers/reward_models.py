"""Tiny reward models (rl_megatron/models/tiny_reward_model.py) and transformers' scores of them."""
import torch
import transformers

from rl_megatron.batch import TrainBatch
from rl_megatron.models.tiny import PAD_ID
from rl_megatron.models.tiny_reward_model import digits_reward_model, write_reward_model

__all__ = ["digits_reward_model", "hf_scores", "reward_model_dir"]
reward_model_dir = write_reward_model


def hf_scores(folder: str, batch: TrainBatch) -> torch.Tensor:
    """AutoModelForSequenceClassification's score of each right-padded row of `batch` (its last real token's)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    assert model.config.pad_token_id == PAD_ID == batch.pad_id
    attention_mask = (torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]).long()
    with torch.no_grad():
        return model(batch.input_ids, attention_mask=attention_mask).logits[:, 0]
