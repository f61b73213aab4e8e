"""Megatron held to Hugging Face transformers on the same weights: tiny HF models of each family built locally with
random weights, a batch of right-padded sequences, the actor's config for them, and what transformers computes on
them. The doctor's model checks (`doctor/models.py`) and the parity tests (tests/distributed on gloo, tests/gpu on
CUDA) share them."""
from __future__ import annotations

import glob

import torch
import transformers
from safetensors.torch import load_file

from rl_megatron.batch import TrainBatch
from rl_megatron.config import Config
from rl_megatron.models.tiny import build_tokenizer, family_config
from rl_megatron.preflight import load_config

SEQ, BATCH, PROMPT = 12, 8, 4
VOCAB = 18  # the digits tokenizer's tokens: every tiny family model's vocabulary
# The largest log-prob difference from transformers in float32: Megatron's local layers match to rounding; Transformer
# Engine may run float32 GEMMs in TF32 (10-bit mantissa).
LOG_PROB_TOLERANCE = {"local": 1e-4, "transformer_engine": 2e-3}
# The demo's settings (configs/demo_cpu.yaml) that an actor's passes read, beside those `actor_config` sets.
DEMO_SETTINGS = {"model.make_vocab_size_divisible_by": 1, "actor.optim.lr": 1e-3, "rollout.max_tokens": 1,
                 "data.max_prompt_length": 8}


def make_batch(vocab: int = VOCAB) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    response_mask = torch.zeros(BATCH, SEQ)
    lengths = torch.randint(1, SEQ - PROMPT, (BATCH,), generator=g)
    for row, length in enumerate(lengths.tolist()):
        response_mask[row, PROMPT - 1:PROMPT - 1 + length] = 1.0
        input_ids[row, PROMPT + length:] = 0  # right padding
    advantages = torch.randn(BATCH, generator=g)
    return TrainBatch(input_ids, response_mask, pad_id=0, lengths=PROMPT + lengths, advantages=advantages)


def actor_config(model_dir: str, tp: int, pp: int, vpp: int = 1, **overrides) -> Config:
    """The demo's actor over the model in `model_dir` (its weights) at TP x PP (x VPP), on tp * pp devices, in
    micro-batches of 2 and mini-batches of 4 prompts x 2 answers; `overrides` (config keys) on top."""
    items = {**DEMO_SETTINGS, "model.path": model_dir, "model.random_init": "false",
             "actor.tensor_model_parallel_size": tp, "actor.pipeline_model_parallel_size": pp,
             "actor.virtual_pipeline_model_parallel_size": vpp, "trainer.n_gpus_per_node": tp * pp,
             "actor.micro_batch_size": 2, "rollout.n": 2, "actor.ppo_mini_batch_size": 4,
             "data.train_batch_size": 4, "rollout.temperature": 0.7, **overrides}
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


def family_model_dir(folder, family: str, tied: bool, layers: int = 2, **extra) -> str:
    """A tiny HF model of `family` (`rl_megatron.models.tiny.family_config`) with every parameter random (norm
    weights and biases too, so that a wrong mapping of any of them shows), and the demo model's tokenizer (its 18
    tokens are the model's vocabulary); `extra` sets further config fields."""
    config = family_config(family, tied, layers, **extra)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # gpt-oss's experts clamp their gate and up projections at 7: wide enough weights that a quarter do.
            param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.8 if name.endswith("gate_up_proj") else 0.1)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's and GLM's expert biases (zero when built)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.1)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def hf_model(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_token_log_probs(model, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the next token and the entropy at every position, laid out as the actor returns them (the last
    position's label is the pad id 0)."""
    log_probs = torch.log_softmax(model(input_ids).logits / temperature, -1)
    labels = torch.cat([input_ids[:, 1:], torch.zeros(input_ids.shape[0], 1, dtype=torch.long)], 1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def hf_reference(model_dir: str, batch: TrainBatch, temperature: float):
    """transformers' (log-probs, entropy, state dict) of the model in `model_dir` on `batch`."""
    model = hf_model(model_dir)
    with torch.no_grad():
        log_probs, entropy = hf_token_log_probs(model, batch.input_ids, temperature)
    return log_probs, entropy, model.state_dict()


def saved_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The tensors transformers' save_pretrained wrote: the HF names a trainer export must reproduce (per-expert
    tensors for MoE models, where the loaded model fuses them; no lm_head with tied embeddings)."""
    tensors = {}
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def tensor_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names missing from either side or whose tensors differ (bitwise), sorted."""
    return sorted(name for name in a.keys() | b.keys()
                  if name not in a or name not in b or not torch.equal(a[name], b[name]))
