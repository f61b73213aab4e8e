"""Shared by the parity tests (tests/distributed on gloo, tests/gpu on CUDA): tiny HF models of each family built
locally with random weights, a batch of right-padded sequences, the actor's config for them, and what Hugging Face
transformers computes on the same weights (the reference every Megatron layout is held to)."""
import torch

from rl_megatron.batch import TrainBatch

SEQ, BATCH, PROMPT = 12, 8, 4


def make_batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    response_mask = torch.zeros(BATCH, SEQ)
    lengths = torch.randint(1, SEQ - PROMPT, (BATCH,), generator=g)
    for row, length in enumerate(lengths.tolist()):
        response_mask[row, PROMPT - 1:PROMPT - 1 + length] = 1.0
        input_ids[row, PROMPT + length:] = 0  # right padding
    advantages = torch.randn(BATCH, generator=g)
    return TrainBatch(input_ids, response_mask, pad_id=0, lengths=PROMPT + lengths, advantages=advantages)


def config(model_dir: str, tp: int, pp: int, vpp: int = 1, **overrides):
    from rl_megatron.config import load_config

    items = {"model.path": model_dir, "model.random_init": "false", "actor.tensor_model_parallel_size": tp,
             "actor.pipeline_model_parallel_size": pp, "actor.virtual_pipeline_model_parallel_size": vpp,
             "trainer.n_gpus_per_node": tp * pp,
             "actor.micro_batch_size": 2, "rollout.n": 2, "actor.ppo_mini_batch_size": 4,
             "data.train_batch_size": 4, "rollout.temperature": 0.7, **overrides}
    return load_config("configs/demo_cpu.yaml", [f"{k}={v}" for k, v in items.items()])


def family_model_dir(folder, family: str, tied: bool, layers: int = 2, **extra) -> str:
    """A tiny HF model of `family` (`rl_megatron.models.tiny.family_config`) with every parameter random (norm
    weights and biases too, so that a wrong mapping of any of them shows), and the demo model's tokenizer (its 18
    tokens are the model's vocabulary); `extra` sets further config fields."""
    import transformers

    from rl_megatron.models.tiny import build_tokenizer, family_config

    config = family_config(family, tied, layers, **extra)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's and GLM's expert biases (zero when built)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(std=0.1)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_token_log_probs(model, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the next token and the entropy at every position, laid out as the actor returns them (the last
    position's label is the pad id 0)."""
    log_probs = torch.log_softmax(model(input_ids).logits / temperature, -1)
    labels = torch.cat([input_ids[:, 1:], torch.zeros(input_ids.shape[0], 1, dtype=torch.long)], 1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def hf_reference(model_dir: str, batch: TrainBatch, temperature: float):
    model = hf_model(model_dir)
    with torch.no_grad():
        log_probs, entropy = hf_token_log_probs(model, batch.input_ids, temperature)
    return log_probs, entropy, model.state_dict()


def long_tailed_batch(count: int = 16) -> TrainBatch:
    """Responses of 1 to 40 tokens, most short (a log-normal tail, as chains of thought), in random order."""
    g = torch.Generator().manual_seed(5)
    lengths = (torch.randn(count, generator=g) * 0.9 + 1.8).exp().round().clamp(1, 40).long()
    width = PROMPT + int(lengths.max())
    input_ids = torch.randint(3, 18, (count, width), generator=g)
    mask = torch.zeros(count, width)
    for row, length in enumerate(lengths.tolist()):
        mask[row, PROMPT - 1:PROMPT - 1 + length] = 1.0
        input_ids[row, PROMPT + length:] = 0
    noise = lambda scale: scale * torch.randn(mask.shape, generator=g)  # noqa: E731
    return TrainBatch(input_ids, mask, pad_id=0, lengths=PROMPT + lengths, advantages=noise(1.0) * mask)
