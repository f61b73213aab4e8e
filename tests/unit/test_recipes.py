"""The recipes users launch (configs/*_countdown.yaml, *_gsm8k.yaml, *_gsm8k_lora.yaml, *_math_8k.yaml,
*_math_async.yaml, *_tool_math.yaml, dapo_qwen2_5_7b_math.yaml, gspo_qwen3_30b_a3b_math.yaml, configs/moe/grpo_qwen3_30b_a3b.yaml, the
scale recipes: Llama 3.1 8B and 70B, Moonlight-16B-A3B, configs/deepseek_v3/, GLM-4.5-Air, configs/gpt_oss/, the Gated
DeltaNet hybrids Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B, the latter on H200s) load, validate and fit their
cluster, activations included (every pool's peak phase under an H100's 80 GiB): each with the real model's config.json
and data prepared by
`python -m rl_megatron.data.prepare`'s entry point, called here (DAPO's files, already in verl's layout, written here). The DAPO and GSPO
recipes also keep their papers' hyper-parameters."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.model_folders import write_header_only_weights, write_text_tokenizer, write_tool_text_tokenizer
from helpers.runs import REPO

from rl_megatron.algorithms import overlong_penalty
from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.data import prepare as data_prepare
from rl_megatron.planning import build_plan, format_plan
from rl_megatron.planning.memory import GIB
from rl_megatron.rewards import score
from rl_megatron.tools import sandbox

# The config.json fields of the released models that shape the layout and the memory.
QWEN2_5 = {"3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                      tie_word_embeddings=True),
           "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                      tie_word_embeddings=False),
           # Qwen3-30B-A3B: 128 experts, 8 per token, 3.3B of its 30.5B parameters active
           "30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                           intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                           vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
                           eos_token_id=151645)}
LLAMA3_1 = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=8, vocab_size=128256,
                rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                eos_token_id=[128001, 128008, 128009])  # the Instruct models end a turn with <|eot_id|> (128009)
RELEASED = {"llama3.1-8b": dict(LLAMA3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32),
            "llama3.1-70b": dict(LLAMA3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64),
            # DeepSeek-V3's family: multi-head latent attention, the first layer(s) dense, sigmoid routing with an
            # expert bias over 64 experts (6 a token) beside 2 shared ones
            "moonlight-16b-a3b": dict(
                architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048,
                intermediate_size=11264, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, vocab_size=163840,
                rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
                bos_token_id=163584, eos_token_id=163585, num_nextn_predict_layers=0),
            # 61 layers (a prime), the first 3 dense; 256 experts (8 a token) in 8 groups, 4 chosen; YaRN to 160k
            "deepseek-v3": dict(
                architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                first_k_dense_replace=3, moe_layer_freq=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, vocab_size=129280,
                rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                "beta_slow": 1},
                max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
                eos_token_id=1, num_nextn_predict_layers=1),
            # GQA with q/k/v biases and half-rotary heads; the first layer dense, 128 experts (8 a token) + 1 shared
            "glm-4.5-air": dict(
                architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=46, hidden_size=4096,
                intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=1408,
                first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000,
                vocab_size=151552, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                pad_token_id=151329, eos_token_id=[151329, 151336, 151338], num_nextn_predict_layers=1),
            # every layer routes over biased experts (4 a token), their width 2880; 64 query heads over 8 kv heads
            # with sinks; a 128-token window on every other layer; YaRN to 128k
            **{f"gpt-oss-{size}": dict(
                architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=layers,
                num_local_experts=experts, num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, attention_bias=True, sliding_window=128,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2), swiglu_limit=7.0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
                vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                pad_token_id=199999, eos_token_id=[200002, 199999, 200012])
               for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))},
            # the Gated DeltaNet hybrids, as shipped for the dry run (configs/models/*/config.json): Qwen3.5's language
            # model (`convert language-model` of the released multimodal folder) and Qwen3-Next
            **{size: json.loads(open(f"{REPO}/configs/models/{folder}/config.json").read())
               for size, folder in (("qwen3.5-35b-a3b-text", "Qwen3.5-35B-A3B-text"),
                                    ("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B-Instruct"))}}
GPU_GIB = {"qwen3-next-80b-a3b": 140}  # the recipes for H200s (141 GB); every other one fits an 80 GB H100


def model_folder(tmp_path, size, tools=False):
    """The released model's config.json, a small text tokenizer and safetensors of the model's shapes whose data
    are holes (the pre-flight check reads the headers only). `tools`: an instruct model's, ending turns with
    <|im_end|> (the tokenizer's id 2) and a chat template in Qwen2.5's tool format."""
    folder = tmp_path / f"model-{size}"
    folder.mkdir()
    config = RELEASED.get(size) or {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "bos_token_id": 151643, "eos_token_id": 2 if tools else 151643, **QWEN2_5[size]}
    (folder / "config.json").write_text(json.dumps(config))
    (write_tool_text_tokenizer if tools else write_text_tokenizer)(str(folder))
    write_header_only_weights(str(folder), config, files=4)
    return str(folder)


def prepare(tmp_path, task, *args):
    out = tmp_path / task
    assert data_prepare.main([task, "--out", str(out), *args]) == 0
    return out


def dapo_file(tmp_path):
    """A row as in DAPO-Math-17k and DAPO's AIME-2024 (verl's layout; data_source math_dapo, the "Answer:" line)."""
    row = {"data_source": "math_dapo",
           "prompt": [{"role": "user", "content": "Solve the following math problem step by step. The last line of "
                       "your response should be of the form Answer: $Answer (without quotes) where $Answer is the "
                       "answer to the problem.\n\nWhat is $3 + 4$?\n\nRemember to put your answer on its own line "
                       "after \"Answer:\"."}],
           "ability": "MATH", "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
           "extra_info": {"index": "0"}}
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    return path


@pytest.mark.parametrize("recipe,size,task", [("grpo_qwen2_5_3b_countdown", "3b", "countdown"),
                                              ("ppo_qwen2_5_3b_countdown", "3b", "countdown"),
                                              ("grpo_qwen2_5_7b_gsm8k", "7b", "gsm8k"),
                                              ("grpo_qwen2_5_7b_gsm8k_lora", "7b", "gsm8k"),
                                              ("grpo_qwen2_5_7b_math_8k", "7b", "dapo"),
                                              ("grpo_qwen2_5_7b_math_async", "7b", "dapo"),
                                              ("grpo_qwen2_5_3b_tool_math", "3b", "gsm8k"),
                                              ("dapo_qwen2_5_7b_math", "7b", "dapo"),
                                              ("moe/grpo_qwen3_30b_a3b", "30b-a3b", "math"),
                                              ("gspo_qwen3_30b_a3b_math", "30b-a3b", "math"),
                                              ("grpo_llama3_1_8b_math", "llama3.1-8b", "math"),
                                              ("grpo_llama3_1_70b_math", "llama3.1-70b", "math"),
                                              ("grpo_moonlight_16b_a3b_math", "moonlight-16b-a3b", "math"),
                                              ("deepseek_v3/grpo_deepseek_v3_math", "deepseek-v3", "math"),
                                              ("grpo_glm4_5_air_math", "glm-4.5-air", "math"),
                                              ("gpt_oss/grpo_gpt_oss_20b_math", "gpt-oss-20b", "math"),
                                              ("gpt_oss/grpo_gpt_oss_120b_math", "gpt-oss-120b", "math"),
                                              ("grpo_qwen3_5_35b_a3b_math", "qwen3.5-35b-a3b-text", "math"),
                                              ("grpo_qwen3_next_80b_a3b_math", "qwen3-next-80b-a3b", "math")])
def test_recipe_fits_its_cluster(tmp_path, recipe, size, task):
    if task == "dapo":
        train = val = dapo_file(tmp_path)
    elif task == "countdown":
        out = prepare(tmp_path, task, "--num-samples", "16", "--test-size", "4")
        train, val = out / "train.parquet", out / "test.parquet"
    else:
        source = tmp_path / "train.jsonl"
        source.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?",
                                      "answer": "3 + 4 = 7\n#### 7", "problem": "What is $3 + 4$?",
                                      "solution": "It is $\\boxed{7}$."}) + "\n")
        train = val = prepare(tmp_path, task, "--input", str(source)) / "train.parquet"
    tools = "tool" in recipe
    if tools and not sandbox.available():
        pytest.skip("the recipe's python tool refuses to start where user namespaces are off (docs/sandbox.md)")
    cfg = load_config(f"{REPO}/configs/{recipe}.yaml", [f"model.path={model_folder(tmp_path, size, tools)}",
                                                        f"data.train_files=[{train}]", f"data.val_files=[{val}]"])
    gib = GPU_GIB.get(size, 80)
    pools = build_plan(cfg, gpu_memory_gib=gib).pools  # a layout that does not fit its nodes is refused here
    assert max(pool.memory_bytes for pool in pools) < gib * GIB  # the memory estimate fits the recipe's GPUs
    plan = format_plan(cfg, gpu_memory_gib=gib)
    assert "WARNING" not in plan, plan
    assert f"{cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} GPUs" in plan
    if tools:  # whole trajectories (4096 tokens after a 1024-token prompt) in the engines and the token budget
        assert cfg.rollout.max_model_len == 1024 + 4096 and "5120 tokens per micro-batch" in plan
    if size == "30b-a3b":  # experts whole (ETP=1) and split over one node's 8 GPUs, apart from attention's TP=2
        assert "TP=2 PP=2 CP=1 EP=8 ETP=1 DP=8" in plan and "actor 23.0 GiB" in plan
        assert ", routing " in plan  # the engines' routing (moe.engine_routing, on for MoE models) in the passes
    if size.startswith("gpt-oss"):  # the parameters counted with their biases and sinks, as released
        assert {"20b": "20.9 B parameters", "120b": "117 B parameters"}[size.split("-")[-1]] in plan
        assert "ETP=1" in plan and {"20b": "training 59.9 GiB", "120b": "training 70.8 GiB"}[size.split("-")[-1]] in plan
    if recipe == "grpo_qwen2_5_7b_gsm8k_lora":  # the frozen base, rank-64 adapters trained, no reference model
        # The engines load the adapters (all 28 layers' at rank 64, bf16) on the base they were sent once.
        assert "actor 4.4 GiB (1.9 B params/GPU frozen + 74.1 M LoRA" in plan and "merged" not in plan
        assert "then only the adapters, 0.3 GiB (vLLM LoRA)" in plan
        assert "weight sync 12.4 GiB (actor weights 3.5 +" in plan and "ref " not in plan
        data = [f"model.path={cfg.model.path}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
        merged = format_plan(load_config(f"{REPO}/configs/{recipe}.yaml", [*data, "actor.lora.merge=true"]),
                             gpu_memory_gib=80)  # the adapted layers' merged weights kept for the sync
        assert "actor 7.4 GiB (1.9 B params/GPU frozen + 74.1 M LoRA" in merged and "1.63 B merged" in merged
        assert "weight sync 15.4 GiB (actor weights 6.6 +" in merged
        full = load_config(f"{REPO}/configs/grpo_qwen2_5_7b_gsm8k.yaml", data)
        assert "actor 21.3 GiB (1.9 B params/GPU: weights + fp32 grads + Adam" in format_plan(full, gpu_memory_gib=80)
    if task == "dapo":
        assert score("math_dapo", "3 + 4 = 7.\nAnswer: 7", "7")["score"] == 1.0  # DAPO's scorer reads its source
    if recipe == "grpo_qwen2_5_7b_math_async":  # one-step-off: the engines on a node of their own, TIS for the lag
        assert cfg.trainer.rollout_staleness == 1 and cfg.rollout.partial_rollout
        assert cfg.rollout.placement == "separate"
        correction = cfg.algorithm.rollout_correction
        assert (correction.level, correction.mode, correction.threshold) == ("token", "truncate", 2.0)
        assert "node 0: actor pool, 1 x 8 = 8 GPUs" in plan and "node 1: rollout pool, 1 x 8 = 8 GPUs" in plan
        assert "TP=1, 8 engines" in plan
        # the actor's GPUs are its own: its state and the update's activations without recompute, no engine share
        assert "actor pool: 53.1 GiB = actor 21.3 GiB" in plan and "rollout pool: 72.0 GiB" in plan
        assert "16384 tokens per micro-batch, no recompute" in plan
    if recipe == "grpo_qwen2_5_7b_math_8k":  # 8k responses: the activations of 16384-token micro-batches, recomputed
        assert "actor pool: 40.0 GiB at its peak (generation), of actor 21.3 GiB" in plan and "rollout 40.0 GiB" in plan
        assert "activations 8.2 GiB (the actor's; one pass at a time)" in plan
        assert "training 31.0 GiB (actor 21.3 + activations 8.2 + CUDA graphs 1.5)" in plan
        assert "16384 tokens per micro-batch, full recompute" in plan
        # Without recomputation the update's 28 layers of activations (31.8 GiB) fit the training phase, while the
        # engine sleeps; beside the engine (actor.offload=false: all at once) they would not.
        keys = [f"actor.{key}=null" for key in ("recompute_granularity", "recompute_method", "recompute_num_layers")]
        overrides = [f"model.path={cfg.model.path}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", *keys]
        assert "training 54.6 GiB, the peak" in format_plan(load_config(f"{REPO}/configs/{recipe}.yaml", overrides),
                                                            gpu_memory_gib=80)
        with pytest.raises(ConfigError, match=r"needs ~93.1 GiB per GPU \(actor .*actor.recompute_granularity=null "
                                              r"to full.*actor.offload=false to true"):
            format_plan(load_config(f"{REPO}/configs/{recipe}.yaml", [*overrides, "actor.offload=false"]),
                        gpu_memory_gib=80)
    if recipe == "dapo_qwen2_5_7b_math":  # DAPO's four techniques with the paper's values, and no KL
        actor, algorithm = cfg.actor, cfg.algorithm
        assert (actor.policy_loss, actor.clip_ratio_low, actor.clip_ratio_high) == ("ppo", 0.2, 0.28)
        assert actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss and not algorithm.use_kl_in_reward
        assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_prompt_length) == (512, 16, 2048)
        assert cfg.data.train_batch_size // actor.ppo_mini_batch_size == 16  # optimizer steps per RL step
        groups = algorithm.filter_groups
        assert groups.enable and groups.metric == "acc" and groups.max_num_gen_batches == 10
        assert cfg.data.gen_batch_size == 3 * cfg.data.train_batch_size
        buffer = cfg.reward.overlong_buffer
        assert buffer.enable and (buffer.len, buffer.penalty_factor, cfg.rollout.max_tokens) == (4096, 1.0, 20480)
        lengths = torch.tensor([16384, 18432, 20480])  # the penalty starts at 16k and reaches 1.0 at 20k tokens
        assert overlong_penalty(lengths, cfg.rollout.max_tokens, buffer.len, buffer.penalty_factor).tolist() == [
            0.0, -0.5, -1.0]
        optim = actor.optim
        assert (optim.lr, optim.weight_decay, optim.clip_grad, optim.lr_warmup_steps) == (1e-6, 0.1, 1.0, 10 * 16)
        assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
        # 20k-token responses: one longest sample per micro-batch, recomputed, beside the engine's half
        assert "64 GPUs" in plan and "TP=4 PP=1 CP=1 EP=1 DP=16" in plan
        assert "actor pool: 40.0 GiB at its peak (generation), of actor 12.0 GiB" in plan and "rollout 40.0 GiB" in plan
        assert "training 24.7 GiB (actor 12.0 + activations 11.2 + CUDA graphs 1.5)" in plan
        assert "activations 11.2 GiB (the actor's; one pass at a time)" in plan
        assert "22528 tokens per micro-batch, full recompute" in plan
    if recipe == "gspo_qwen3_30b_a3b_math":  # sequence-level ratio with the paper's tiny clip range, no KL
        actor = cfg.actor
        assert (actor.policy_loss, actor.clip_ratio_low, actor.clip_ratio_high) == ("gspo", 3e-4, 4e-4)
        assert actor.loss_agg_mode == "seq-mean-token-mean" and not actor.use_kl_loss
        assert not cfg.algorithm.use_kl_in_reward and "ref " not in plan  # no reference model without KL
        assert cfg.data.train_batch_size // actor.ppo_mini_batch_size == 4  # the paper's four mini-batches
        assert cfg.rollout.n == 16 and cfg.moe.router_dtype == "fp32"
        buffer = cfg.reward.overlong_buffer
        assert buffer.enable and (buffer.len, buffer.penalty_factor, cfg.rollout.max_tokens) == (4096, 1.0, 8192)
        # 8k-token responses in the MoE recipe's layout: a token budget and full recompute instead of 1 sample
        assert "actor pool: 36.0 GiB at its peak (generation), of actor 23.0 GiB" in plan and "rollout 36.0 GiB" in plan
        assert "training 34.7 GiB (actor 23.0 + activations 10.2 + CUDA graphs 1.5)" in plan
        assert "10240 tokens per micro-batch, full recompute" in plan

    if size in ("qwen3.5-35b-a3b-text", "qwen3-next-80b-a3b"):  # the experts folded as Qwen3-30B-A3B's; engines at
        # TP=2, all the 2 key-value heads allow; each sample's Gated DeltaNet state among the engine's caches
        assert "TP=2 PP=2 CP=1 EP=8 ETP=1 DP=8" in plan and "TP=2, 16 engines" in plan
    if size == "qwen3.5-35b-a3b-text":
        assert "34.7 B parameters" in plan and "15.7 MiB of it Gated DeltaNet state" in plan
        assert "generation 48.0 GiB, the peak (rollout 48.0)" in plan and "training 35.3 GiB" in plan
    if size == "qwen3-next-80b-a3b":  # an engine's half of the weights alone is 74.2 GiB: no room on an H100
        assert "79.7 B parameters" in plan and "18.8 MiB of it Gated DeltaNet state" in plan
        assert "weights 74.2 GiB" in plan and "generation 112.0 GiB, the peak (rollout 112.0)" in plan
        with pytest.raises(ConfigError, match="GiB per GPU"):
            build_plan(cfg, gpu_memory_gib=80)

    if recipe == "grpo_llama3_1_8b_math":  # the smallest TP that fits beside the engines; GRPO's KL to the reference
        assert "TP=4 PP=1 CP=1 EP=1 DP=2" in plan and "TP=2, 4 engines" in plan and cfg.actor.use_kl_loss
        assert "actor pool: 40.0 GiB at its peak (generation), of actor 22.4 GiB" in plan and "ref 3.7 GiB" in plan
        # the reference's weights wait in host memory (ref.param_offload): in no phase
        assert "training 27.4 GiB (actor 22.4 + activations 3.5 + CUDA graphs 1.5)" in plan
        assert "8192 tokens per micro-batch, full recompute" in plan
    if recipe == "grpo_llama3_1_70b_math":  # a node per TP group and per stage; no reference
        assert "TP=8 PP=4 CP=1 EP=1 DP=1" in plan and "TP=8, 4 engines" in plan and "ref " not in plan
        assert "actor pool: 43.1 GiB at its peak (training), of actor 38.1 GiB" in plan and "rollout 32.0 GiB" in plan
        assert "16384 tokens per micro-batch, full recompute" in plan

    if recipe == "grpo_moonlight_16b_a3b_math":  # MLA; 8 whole experts a GPU on the node, attention at TP=4
        assert "TP=4 PP=1 CP=1 EP=8 ETP=1 DP=2" in plan and "TP=2, 4 engines" in plan
        assert "actor pool: 40.7 GiB at its peak (training), of actor 34.8 GiB" in plan and "rollout 32.0 GiB" in plan
    if recipe == "deepseek_v3/grpo_deepseek_v3_math":  # 61 layers over 16 stages; engines over 4 whole nodes
        assert "TP=8 PP=16 (layers 3+14x4+2) CP=1 EP=32 ETP=1 DP=4" in plan and "TP=32, 16 engines" in plan
        assert "each vLLM engine (32 GPUs) spans 4 whole nodes" in plan and cfg.model.dtype == "bfloat16"
        assert "actor pool: 48.0 GiB at its peak (generation), of actor 25.1 GiB" in plan and "rollout 48.0 GiB" in plan
        # the sync holds both models' weights: the engine's 39.1 GiB share of 1.3 TB beside the actor's shards
        assert "weight sync 43.8 GiB (actor weights 3.0 + engine weights 39.1 + buckets 0.2 + CUDA graphs 1.5)" in plan
        assert "8192 tokens per micro-batch, full recompute" in plan
        # An even split of 61 layers is refused, naming the uneven keys.
        keys = ["actor.num_layers_in_first_pipeline_stage=null", "actor.num_layers_in_last_pipeline_stage=null"]
        with pytest.raises(ConfigError, match="num_layers_in_last_pipeline_stage=1 \\(15x4\\+1 layers\\)"):
            load_config(f"{REPO}/configs/{recipe}.yaml", [f"model.path={cfg.model.path}", f"data.train_files=[{train}]",
                                                          f"data.val_files=[{val}]", *keys])
    if recipe == "grpo_glm4_5_air_math":  # 4 nodes: the experts' state and the engine take turns on the GPU
        assert "4 node(s), 32 GPUs" in plan
        assert "TP=8 PP=2 CP=1 EP=16 ETP=1 DP=2" in plan and "TP=8, 4 engines" in plan
        assert "actor pool: 62.0 GiB at its peak (training), of actor 58.4 GiB" in plan and "rollout 56.0 GiB" in plan
        assert ("training 62.0 GiB, the peak (actor 58.4 + activations 2.0 + CUDA graphs 1.5) | generation 56.0 GiB "
                "(rollout 56.0) | weight sync 33.4 GiB (actor weights 6.8 + engine weights 24.9 + buckets 0.2 + "
                "CUDA graphs 1.5)") in plan
        # Added up as if all were on the GPU at once, the same layout is refused, naming offloading among the fixes.
        with pytest.raises(ConfigError, match=r"needs ~116.5 GiB per GPU \(actor 58.4 GiB \+ rollout 56.0 GiB .*"
                                              r"actor.offload=false to true"):
            build_plan(load_config(f"{REPO}/configs/{recipe}.yaml", [
                f"model.path={cfg.model.path}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                "actor.offload=false"]), gpu_memory_gib=80)


def test_recipe_names_the_one_key_to_set():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(f"{REPO}/configs/grpo_qwen2_5_3b_countdown.yaml")
