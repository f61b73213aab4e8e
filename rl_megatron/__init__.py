"""rl_megatron: RL post-training (GRPO, PPO and relatives) of LLMs on Megatron-core, with vLLM rollouts, driven by
Ray. The training loop is `rl_megatron/trainer/trainer.py`; `docs/architecture.md` maps every package."""
