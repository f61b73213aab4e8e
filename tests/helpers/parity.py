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


# Multi-head latent attention at the sizes vLLM's CPU kernel decodes (kv_lora_rank + qk_rope_head_dim = 512 + 64);
# one dense layer first, 4 routed experts (top-2) and shared experts. DeepSeek-V3: sigmoid scores with the expert
# bias, 2 groups of which each token may use 1 (2 = top-k / topk_group experts per group, as Megatron scores groups),
# YaRN whose mscale enters the softmax scale. V2(-Lite): softmax scores, no renormalisation, q_proj without LoRA.
MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
           head_dim=64,  # what DeepSeek configs write: the rotary dimensions
           v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           first_k_dense_replace=1, rms_norm_eps=1e-6)
DEEPSEEK_V3 = dict(MLA, q_lora_rank=32, n_shared_experts=1, n_group=2, topk_group=1, topk_method="noaux_tc",
                   scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
DEEPSEEK_V2 = dict(MLA, q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy",
                   norm_topk_prob=False, routed_scaling_factor=1.5,
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                 "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
# GLM-4.5: half of each head rotates, q/k/v biases and per-head q/k norms, sigmoid routing with the expert bias.
GLM4_MOE = dict(partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5)


def family_model_dir(folder, family: str, tied: bool, layers: int = 2, **extra) -> str:
    """A tiny HF model of `family` with every parameter random (norm weights and biases too, so that a wrong
    mapping of any of them shows), and the demo model's tokenizer (its 18 tokens are the model's vocabulary);
    `extra` sets further config fields."""
    import transformers

    from rl_megatron.models.tiny import build_tokenizer

    config_class = transformers.AutoConfig.for_model
    # 4 experts, top-2. Qwen3-MoE: weights renormalised (as Qwen's released models), half-width experts;
    # Mixtral always renormalises, and its experts are as wide as intermediate_size.
    # Qwen2-MoE: not renormalised (its default), a shared expert of its own width with its gate.
    moe = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64),
           "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=96),
           "deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "glm4_moe": GLM4_MOE}.get(family, {})
    config = config_class(family, **dict(dict(vocab_size=18, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=tied, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2), **{**moe, **extra}))
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
