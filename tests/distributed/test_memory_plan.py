"""The memory plan's activations held to what autograd really keeps (issue 52 item 8): for every model family's tiny
model, on one CPU rank in float32 at TP=1, the bytes one training forward over one micro-batch leaves saved for the
backward pass (`rl_megatron.bench.recompute.saved_bytes`, per decoder layer and outside the layers) against the
planner's figures for the same micro-batch and the same keys (`plan.role_passes` reads the very config the actor is
built from): each layer's (`layer_memory.layer_bytes`), what the plan keeps outside the layers (the final norm's and
the output layer's inputs, and full recomputation's checkpoints) and the whole update pass (`activation_bytes`) less
its logits, which the forward's end (the logits) does not save.

Each family in both CPU layouts (right-padded rows: Megatron's local attention, which keeps its softmax; packed rows:
torch's fused attention per span), without recomputation, with selective recomputation (the attention core) and with
full recomputation (every layer, one at a time). Tiny models make some terms large (the rotary tables, the norms'
fp32 copies, the softmax over 32 keys) and others small; comparing layer by layer keeps a wrong term from hiding
behind the vocabulary's or another layer's. The families' own tiny models (models/tiny.py's FAMILY_FIELDS) with 4
query heads over 2 key/value heads (GQA, as every released model of these families) but for Qwen2, the demo's
model, which keeps one key/value head per query head, and DeepSeek's latent attention.

One spawned rank measures everything: 17 s of CPU in all (75-111 s of wall time under a load average of ~30).
"""
import pytest
import torch

from helpers.worlds import run_distributed
from rl_megatron.batch import TrainBatch
from rl_megatron.planning.memory import FP32, WEIGHT_BYTES, activation_bytes, head_bytes, layer_bytes
from rl_megatron.planning.model_shape import ModelShape
from rl_megatron.planning.plan import role_passes
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.tiny import build_tokenizer, family_config
from rl_megatron.preflight import load_config
from rl_megatron.roles import Role

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
            "glm4_moe", "gpt_oss")
GROUPED = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # vLLM's CPU attention takes 32
UNGROUPED = ("qwen2", "deepseek_v2", "deepseek_v3")
MODES = {
    "off": (),
    "selective": ("actor.recompute_granularity=selective",),
    "full": ("actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1"),
}
PROMPT, RESPONSE, ROWS = 16, 16, 2  # a micro-batch of 2 samples of 32 tokens: T = 64, S = 32
# What the plan leaves out of a layer, relative to what the layer keeps: each norm's fp32 1/rms per row (8 bytes a
# token, more with per-head Q/K norms), the masks (local attention's [S, S] bool; a sliding window's, bool and
# float, per span length), the fused kernel's log-sum-exp (fp32 per head) and DeepSeek-V3's group scores. Measured
# at most 1.4% here (Mistral's window masks, 88 of 6.5k bytes a token), the rest under 0.8%; the plan's smallest
# terms at these sizes (the rotary tables, the softmax over 32 keys, a routed copy's sixth f_e) are 2-8%.
LAYER_TOLERANCE = 0.02
# Outside the layers the plan leaves out, per token: the token ids the embedding keeps (int64) and the final norm's
# 1/rms (fp32); under full recomputation also the rotary frequencies each checkpoint keeps (one fp32 table over the
# rotated dimensions per position, shared; MLA computes its own inside the layers). With them the figures agree to
# the byte; the tolerance is rounding.
IDS_AND_NORM_STATISTICS = 8 + FP32
OUTSIDE_TOLERANCE = 0.001


def model_folder(folder, family: str) -> str:
    """The family's tiny model (random weights: Megatron's own initialisation) and the digits tokenizer."""
    extra = {} if family in UNGROUPED else GROUPED
    family_config(family, layers=2, **extra).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def actor_config(model_dir: str, mode: str, packing: bool):
    return load_config(None, [
        f"model.path={model_dir}", "model.random_init=true", "model.dtype=float32", "trainer.n_gpus_per_node=1",
        f"data.max_prompt_length={PROMPT}", f"rollout.max_tokens={RESPONSE}", "rollout.n=1",
        f"data.train_batch_size={ROWS}", f"actor.ppo_mini_batch_size={ROWS}", f"actor.micro_batch_size={ROWS}",
        "model.make_vocab_size_divisible_by=1", f"actor.sequence_packing={str(packing).lower()}", *MODES[mode]])


def micro_batch() -> TrainBatch:
    """ROWS samples of the longest length the config allows: the micro-batch the plan assumes, T = ROWS * L."""
    ids = torch.randint(3, 18, (ROWS, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(0))
    return TrainBatch(ids, torch.zeros(ids.shape), pad_id=0)


def saved_per_mode(configs: dict, batch: TrainBatch) -> dict:
    """On the rank: for each (family, mode) the actor of that config, and what one training forward of it saves over
    `batch` right-padded and packed (`SavedBytes`)."""
    # Imported on the rank: the test's own process never loads Megatron.
    from rl_megatron.bench.recompute import saved_micro_batch_bytes
    from rl_megatron.workers.megatron_actor import MegatronActor

    saved = {}
    for key, cfg in configs.items():
        actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=1)
        for packing in (False, True):
            saved[(*key, packing)] = saved_micro_batch_bytes(actor, batch, packing)
    return saved


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folders = {family: model_folder(tmp_path_factory.mktemp(family), family) for family in FAMILIES}
    configs = {(family, mode): actor_config(folder, mode, packing=True)
               for family, folder in folders.items() for mode in MODES}
    return folders, run_distributed(saved_per_mode, 1, args=(configs, micro_batch()))[0]


def planned(model_dir: str, mode: str, packing: bool):
    """The plan's passes for the actor of this config at TP=1, and the model's shape."""
    cfg = actor_config(model_dir, mode, packing)
    hf = read_hf_config(model_dir)
    passes = role_passes(Role.ACTOR, cfg, {"tp": 1, "pp": 1}, False, hf)
    assert passes.tokens == ROWS * (PROMPT + RESPONSE) and passes.attention == ("spans" if packing else "local")
    return passes, ModelShape.of(hf)


def rotary_frequencies(shape: ModelShape, passes) -> float:
    """Bytes per token of the rotary frequencies the checkpoints of full recomputation keep (none with MLA)."""
    return 0.0 if shape.latent else FP32 * shape.rotated * passes.row_tokens / passes.tokens


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_matches_the_bytes_autograd_saves(measured, family, mode, packing):
    folders, saved = measured
    saved = saved[family, mode, packing]
    passes, shape = planned(folders[family], mode, packing)
    tokens, w = passes.tokens, WEIGHT_BYTES[passes.dtype]
    layers = [layer_bytes(shape, passes, shape.routes(i), i in shape.windowed) for i in range(shape.layers)]
    head, logits = head_bytes(shape, passes, logit_copies=0, vocab_multiple=1)
    outside = tokens * (head - logits + IDS_AND_NORM_STATISTICS)
    if mode == "full":  # every layer recomputed: only each one's input is kept, outside the layers
        assert saved.layers == (0,) * shape.layers
        outside += tokens * (shape.layers * w * shape.hidden + rotary_frequencies(shape, passes))
    else:
        for i, (layer, figure) in enumerate(zip(layers, saved.layers)):
            plan = tokens * (layer.selective if mode == "selective" else layer.kept)
            assert figure == pytest.approx(plan, rel=LAYER_TOLERANCE), f"layer {i}: measured {figure}, planned {plan}"
    assert saved.other == pytest.approx(outside, rel=OUTSIDE_TOLERANCE)
    if mode == "off":  # the plan's figure for the update: its layers and head, the logits' copies aside
        estimate = activation_bytes(shape, passes)
        assert saved.total == pytest.approx(estimate.update - estimate.logits, rel=LAYER_TOLERANCE)
