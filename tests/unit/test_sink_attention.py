"""gpt-oss's attention sinks on a CUDA run without Transformer Engine (preflight/sink_attention.py): the scores its
local attention forms, by hand, and the pre-flight refusal of lengths whose scores the memory plan has no room for,
with gpt-oss-20b's released config.json and its recipe's layout (TP=2, 8192-token micro-batches, an H100's 80 GiB).

The small shape of test_activation_memory.py: h = 64, 4 heads of 16 (h_q = 64), 2 kv heads, 4 layers, vocabulary
100, bfloat16 (w = 2), TP 2 with sequence parallelism, T = S = 1000 tokens. A = 1184 bytes per token, the update's
head 628. With the sinks (layers/memory.py's "sinks": torch's attention, whose unfused RoPE keeps its tables, 2 * 4 *
16 = 128) each layer keeps, instead of the core's inputs QKV and RoPE's Q and K (2 * (64 + 32 + 16) / 2 = 112 * 2 =
224), the query's copy and K, V repeated to every head (2 * 3 * 64 / 2 = 192) and the softmax over S keys and the
sink (4 / 2 * 1001 * 2 = 4004): C = 4196, A' = 1184 + 128 - 224 + 4196 = 5284; selective recompute keeps the
inputs, 1184 + 128 = 1312.
"""
import importlib.util
import json

import pytest
from helpers.model_folders import write_text_tokenizer
from helpers.runs import REPO

from rl_megatron import platform
from rl_megatron.config import ConfigError
from rl_megatron.planning.memory import ModelShape, RolePasses, layer_bytes
from rl_megatron.models.hf_config import model_config
from rl_megatron.preflight import load_config, sink_attention
from rl_megatron.preflight.sink_attention import check_sink_attention, layer_score_bytes, sink_attention_bytes

SHAPE = ModelShape(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=4, vocab=100)
T = 1000
# The score-sized tensors beside the kept probabilities at one layer's peak, in a pass that trains (its backward: 4
# of them) and in a forward pass (3): each 4 / 2 heads * T * 1001 * 2 bytes.
SCORES = 2 * T * 1001 * 2
# gpt-oss-20b's config.json fields that shape the memory (as tests/unit/test_recipes.py has them).
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32,
    num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, attention_bias=True, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
    swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    pad_token_id=199999, eos_token_id=[200002, 199999, 200012])


def passes(**changes) -> RolePasses:
    return RolePasses(**{"tokens": T, "row_tokens": T, "tp": 2, "sequence_parallel": True, **changes})


def test_one_layers_scores_by_hand():
    """gpt-oss-20b at the recipe's TP=2: 32 heads a GPU, 8192 tokens in samples of up to 1024 + 4096."""
    assert layer_score_bytes(64, 2, 8192, 5120, "bfloat16", trains=True) == 4 * 32 * 8192 * 5121 * 2  # 10.0 GiB
    assert layer_score_bytes(64, 2, 8192, 5120, "bfloat16", trains=False) == 3 * 32 * 8192 * 5121 * 2  # 7.5 GiB
    assert layer_score_bytes(4, 2, T, T, "float32", trains=False) == 3 * 2 * T * 1001 * 4


def test_what_the_sinks_add_to_the_plan_by_hand():
    assert layer_bytes(SHAPE, passes(attention="sinks")) == (5284, 1312, 4196)
    # No recompute: the update's 4 A + head becomes 4 A' + head.
    assert sink_attention_bytes(SHAPE, passes()) == T * 4 * (5284 - 1184) + 3 * SCORES
    # Selective recompute: the layers keep 1312 each, and the backward remakes one C (4196), larger than the head.
    assert sink_attention_bytes(SHAPE, passes(recompute="selective")) == T * (4 * 1312 + 4196 - 4 * 1184 - 628) + \
        3 * SCORES
    # A forward pass (the reference): its largest layer with the sinks (5284) instead of A (1184), two copies beside.
    assert sink_attention_bytes(SHAPE, passes(trains=False)) == T * (5284 - 1184) + 2 * SCORES


@pytest.fixture()
def gpt_oss_20b(tmp_path, monkeypatch):
    """The gpt-oss-20b recipe with gpt-oss-20b's config.json (random weights), `overrides` on top, on 80 GiB."""
    folder = tmp_path / "gpt-oss-20b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GPT_OSS_20B))
    write_text_tokenizer(str(folder))
    monkeypatch.setenv("GPU_MEMORY_GIB", "80")

    def load(*overrides):
        return load_config(f"{REPO}/configs/gpt_oss/grpo_gpt_oss_20b_math.yaml", [
            f"model.path={folder}", "model.random_init=true", "data.task=arithmetic", "data.train_files=[]",
            "data.val_files=[]", "trainer.val_before_train=false", "trainer.val_every=0", *overrides])
    return load


LONG = ["rollout.max_tokens=16384", "actor.max_tokens_per_micro_batch=17408"]  # 1024 + 16384 tokens


def test_the_recipe_without_te_fits_and_long_samples_are_refused_naming_the_keys(gpt_oss_20b):
    cfg = gpt_oss_20b()
    check_sink_attention(cfg, model_config(cfg), cuda=True, transformer_engine=False)
    long = gpt_oss_20b(*LONG)
    with pytest.raises(ConfigError) as refused:
        check_sink_attention(long, model_config(long), cuda=True, transformer_engine=False)
    message = str(refused.value)
    assert message.startswith("actor: model_type=gpt_oss has attention sinks, and without Transformer Engine")
    assert "micro-batches of 17408 tokens (actor.max_tokens_per_micro_batch=17408) in samples of up to 17408" in message
    assert "of the GPU's 80 GiB (GPU_MEMORY_GIB)" in message
    assert "install Transformer Engine on the GPU nodes (pip install --no-build-isolation" in message
    assert "raise actor.tensor_model_parallel_size=2" in message
    assert "recompute_granularity" not in message  # the recipe recomputes every layer already
    fitting = int(message.split("rollout.max_tokens = 17408 to at most ")[1].split(";")[0])
    # The length it names fits: the same micro-batches, shorter samples.
    shorter = gpt_oss_20b("rollout.max_tokens=" + str(fitting - 1024), "actor.max_tokens_per_micro_batch=17408")
    check_sink_attention(shorter, model_config(shorter), cuda=True, transformer_engine=False)
    with pytest.raises(ConfigError):  # and one token more does not
        longer = gpt_oss_20b("rollout.max_tokens=" + str(fitting - 1023), "actor.max_tokens_per_micro_batch=17408")
        check_sink_attention(longer, model_config(longer), cuda=True, transformer_engine=False)


def test_without_recompute_every_layers_probabilities_count_and_recompute_is_named(gpt_oss_20b):
    cfg = gpt_oss_20b("actor.recompute_granularity=null", "actor.recompute_method=null",
                      "actor.recompute_num_layers=null")
    with pytest.raises(ConfigError, match="set actor.recompute_granularity=selective"):
        check_sink_attention(cfg, model_config(cfg), cuda=True, transformer_engine=False)


def test_no_check_with_te_on_cpu_or_for_families_without_sinks(gpt_oss_20b, monkeypatch):
    long = gpt_oss_20b(*LONG)

    def no_plan(*args, **kwargs):
        raise AssertionError("the plan is built only where the check applies")
    monkeypatch.setattr(sink_attention, "build_plan", no_plan)
    check_sink_attention(long, model_config(long), cuda=True, transformer_engine=True)
    check_sink_attention(long, model_config(long), cuda=False, transformer_engine=False)
    dense = load_config(f"{REPO}/configs/demo_cpu.yaml", [])
    check_sink_attention(dense, model_config(dense), cuda=True, transformer_engine=False)


def test_preflight_runs_it_on_a_cuda_driver(gpt_oss_20b, monkeypatch):
    gpt_oss_20b(*LONG)  # loads on this machine: no CUDA
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    with pytest.raises(ConfigError, match="actor: model_type=gpt_oss has attention sinks"):
        gpt_oss_20b(*LONG)
