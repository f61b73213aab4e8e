"""Uneven pipeline stages (actor.num_layers_in_first_pipeline_stage / actor.num_layers_in_last_pipeline_stage): the
layers each stage and model chunk holds against Megatron-core's own functions, the splits Megatron refuses refused
before anything starts (naming the keys and valid values), and what the planner counts per stage."""
import json

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.planning import format_plan
from rl_megatron.planning.memory import (ModelShape, RankParameters, RolePasses, activation_bytes, in_flight,
                                         rank_parameters)
from rl_megatron.models.gpt import transformer_config
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers, split_problem
from rl_megatron.roles import Role

DEMO = "configs/demo_cpu.yaml"


def megatron_chunks(layers, pp, vpp, first, last) -> list[list[range]]:
    """The layers of every stage's model chunks as Megatron-core builds them (offset and count per chunk)."""
    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1
                               else None, num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last)
    chunks = []
    for rank in range(pp):
        stage = []
        for chunk in (range(vpp) if vpp > 1 else [None]):
            offset = get_transformer_layer_offset(config, chunk, rank)
            stage.append(range(offset, offset + get_num_layers_to_build(config, chunk, rank)))
        chunks.append(stage)
    return chunks


@pytest.mark.parametrize("layers,pp,vpp,first,last,sizes", [
    (61, 16, 1, None, 1, [4] * 15 + [1]),  # DeepSeek-V3: a short last stage
    (61, 4, 1, None, 13, [16, 16, 16, 13]),
    (61, 8, 1, 5, 8, [5] + [8] * 7),
    (3, 2, 1, 1, None, [1, 2]),
    (10, 3, 2, 2, None, [2, 4, 4]),  # interleaved: chunk v of every stage before chunk v + 1
    (14, 4, 2, 2, 4, [2, 4, 4, 4]),
    (8, 2, 1, 3, 5, [3, 5]),
])
def test_stage_layers_are_megatrons(layers, pp, vpp, first, last, sizes):
    split = PipelineSplit(layers, pp, vpp, StageLayers(first, last))
    assert split_problem(layers, pp, vpp, first, last) is None
    assert split.stage_sizes() == sizes
    assert [split.chunks(stage) for stage in range(pp)] == megatron_chunks(layers, pp, vpp, first, last)
    assert sorted(layer for stage in range(pp) for layer in split.stage_layers(stage)) == list(range(layers))


def test_every_split_accepted_is_built_so_by_megatron_and_megatron_refuses_the_rest_it_can_tell():
    """Over small models: each split accepted gives Megatron's layers; each refused one Megatron refuses too, except
    a middle share below one layer, which Megatron-core 0.16.1 accepts and builds as negative layer ranges."""
    for layers in range(2, 10):
        for pp in (2, 3, 4):
            for vpp in (1, 2):
                for first in (None, *range(1, layers)):
                    for last in (None, *range(1, layers)):
                        if first is None and last is None:
                            continue
                        try:
                            built = megatron_chunks(layers, pp, vpp, first, last)
                        except (ValueError, AssertionError, ZeroDivisionError):
                            built = None
                        if split_problem(layers, pp, vpp, first, last) is None:
                            split = PipelineSplit(layers, pp, vpp, StageLayers(first, last))
                            assert built == [split.chunks(stage) for stage in range(pp)], (layers, pp, vpp, first, last)
                        elif built is not None:
                            assert any(len(chunk) == 0 for stage in built for chunk in stage)


def model(tmp_path, layers: int) -> str:
    folder = tmp_path / f"m{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.load(open("configs/models/tiny-qwen2-digits/config.json"))
    config.pop("layer_types", None)  # one per layer in transformers' check
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text(open(f"configs/models/tiny-qwen2-digits/{name}").read())
    return str(folder)


def error(tmp_path, layers, *overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [f"model.path={model(tmp_path, layers)}", "actor.tensor_model_parallel_size=1", *overrides])
    return str(info.value)


def test_refusals_name_the_keys_and_valid_values(tmp_path):
    message = error(tmp_path, 7, "actor.num_layers_in_last_pipeline_stage=1")
    assert "actor.num_layers_in_last_pipeline_stage=1" in message and "actor.pipeline_model_parallel_size=1" in message
    # 7 layers at PP=2 x 1 node of 2 devices: the first and last must add up to 7.
    message = error(tmp_path, 7, "actor.pipeline_model_parallel_size=2", "actor.num_layers_in_first_pipeline_stage=2",
                    "actor.num_layers_in_last_pipeline_stage=4")
    assert "add up to the model's 7 layers" in message and "not 6" in message
    assert "Valid: actor.num_layers_in_first_pipeline_stage=2 actor.num_layers_in_last_pipeline_stage=5 (2+5" in message
    # 13 layers over 4 stages (4 devices), last 2: the 3 stages before it cannot share 11 evenly.
    four = ["trainer.n_gpus_per_node=4", "actor.pipeline_model_parallel_size=4", "rollout.tensor_parallel_size=1"]
    message = error(tmp_path, 13, *four, "actor.num_layers_in_last_pipeline_stage=2")
    assert "leave 11 of the model's 13 layers" in message and "3 stage(s) between" in message
    assert "actor.num_layers_in_last_pipeline_stage=1 (3x4+1 layers)" in message
    # Interleaved: every stage's count splits into the chunks.
    message = error(tmp_path, 12, *four, "actor.virtual_pipeline_model_parallel_size=2", "actor.micro_batch_size=1",
                    "actor.num_layers_in_first_pipeline_stage=3")
    assert "multiples of 2" in message and "actor.virtual_pipeline_model_parallel_size=2" in message
    # Megatron-core divides by the middle stages' count when interleaving: both set at PP=2 is refused there.
    message = error(tmp_path, 8, "actor.pipeline_model_parallel_size=2", "actor.virtual_pipeline_model_parallel_size=2",
                    "actor.num_layers_in_first_pipeline_stage=2", "actor.num_layers_in_last_pipeline_stage=6",
                    "actor.micro_batch_size=1")
    assert "Set actor.num_layers_in_first_pipeline_stage alone" in message
    # An even split that does not divide points at the uneven one, the splits nearest an even one first.
    message = error(tmp_path, 13, *four)
    assert "must divide the model's 13 layers" in message and "Valid: actor.num_layers_in_first_pipeline_stage=4 " \
        "(4+3x3 layers); actor.num_layers_in_last_pipeline_stage=4 (3x3+4 layers)" in message


def test_recompute_groups_must_divide_every_stages_chunks(tmp_path):
    # 13 layers at PP=4 with a last stage of 1: chunks of 4 and 1 layer; groups of 2 fit only the first.
    keys = ["trainer.n_gpus_per_node=4", "actor.pipeline_model_parallel_size=4", "rollout.tensor_parallel_size=1",
            "actor.num_layers_in_last_pipeline_stage=1", "actor.recompute_granularity=full"]
    message = error(tmp_path, 13, *keys, "actor.recompute_method=uniform", "actor.recompute_num_layers=2")
    assert "each model chunk's 1 / 4 layers" in message and "divisor of 1 / 4 (1;" in message
    message = error(tmp_path, 13, *keys, "actor.recompute_method=block", "actor.recompute_num_layers=5")
    assert "at most 4" in message
    cfg = load_config(DEMO, [f"model.path={model(tmp_path / 'ok', 13)}", "actor.tensor_model_parallel_size=1", *keys,
                             "actor.recompute_method=block", "actor.recompute_num_layers=4"])
    assert cfg.actor.num_layers_in_last_pipeline_stage == 1


def test_roles_in_the_actors_processes_follow_its_stages_and_megatron_gets_them(tmp_path):
    cfg = load_config(DEMO, [f"model.path={model(tmp_path, 3)}", "actor.tensor_model_parallel_size=1",
                             "actor.pipeline_model_parallel_size=2", "actor.num_layers_in_first_pipeline_stage=1",
                             "actor.use_kl_loss=true"])
    assert StageLayers.of_role(cfg, Role.ACTOR) == StageLayers.of_role(cfg, Role.REF) == StageLayers(1, None)
    hf = json.load(open(f"{cfg.model.path}/config.json"))
    megatron = transformer_config(hf, tp=1, pp=2, dtype="float32", stages=StageLayers.of_role(cfg, Role.ACTOR))
    assert (megatron.num_layers_in_first_pipeline_stage, megatron.num_layers_in_last_pipeline_stage) == (1, None)
    cfg.ref.placement = "separate"  # its own workers and pipeline, split evenly
    assert StageLayers.of_role(cfg, Role.REF) == StageLayers()


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 18, "tie_word_embeddings": False}


def test_parameters_follow_the_stage_boundaries():
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o; gate, up, down; two norms
    embedding = output = 18 * 64
    # First stage 1 layer + the embedding; last stage 2 layers + final norm + output layer: the last is fuller.
    assert rank_parameters(LLAMA, pp=2, stages=StageLayers(first=1)) == RankParameters(
        dense=2 * layer + 64 + output, expert=0)
    # First stage 2 layers + embedding vs last 1 layer + norm + output: the first.
    assert rank_parameters(LLAMA, pp=2, stages=StageLayers(last=1)).total == 2 * layer + embedding


def test_activations_per_stage_by_hand():
    """One layer keeps A = 2 * (4*64 + 3*64 + 3*64 + 5*128) = 2560 bytes a token (bf16, TP 1, fused attention);
    the head 2 * 2*64 + 18 * (2 + 4*2) = 436."""
    shape = ModelShape.of(LLAMA)
    run = dict(tokens=100, row_tokens=100, pp=2)
    # Even it would not split; first 1: 2 micro-batches of 1 layer (5120) < the last's 2 layers + head (5556).
    assert activation_bytes(shape, RolePasses(**run, stages=StageLayers(first=1))).update == 100 * (2 * 2560 + 436)
    # First 2: 2 micro-batches of 2 layers (10240) on the first stage.
    assert activation_bytes(shape, RolePasses(**run, stages=StageLayers(first=2))).update == 100 * 2 * 2 * 2560
    # Stage s of 1F1B holds PP - s micro-batches; interleaved, Megatron's warm-up + 1 in chunks of 1 / VPP.
    assert [in_flight(4, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, 2, s) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]


def test_plan_prints_the_stage_sizes(tmp_path):
    cfg = load_config(DEMO, [f"model.path={model(tmp_path, 3)}", "actor.tensor_model_parallel_size=1",
                             "actor.pipeline_model_parallel_size=2", "actor.num_layers_in_first_pipeline_stage=1"])
    assert "TP=1 PP=2 (layers 1+2) CP=1 EP=1 DP=1" in format_plan(cfg, on_gpu=False)
