"""`python -m rl_megatron.convert`: HF -> Megatron distributed checkpoint (TP2 x PP2) -> HF is bitwise exact when
loaded back at another layout, the result runs in transformers exactly as the original, and broken or mismatched
checkpoints fail naming the path or field."""
import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers.parity import family_model_dir
from helpers.ranks import vllm_greedy
from rl_megatron.checkpoint import CheckpointError, check_checkpoint, stored_hf_config
from rl_megatron.convert import main
from rl_megatron.doctor.cycle import hf_greedy
from helpers.worlds import run_distributed

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF folder, checkpoint folder saved at TP=2 x PP=2 by 4 processes, the slow part) of a Qwen2 with QKV biases
    and tied embeddings. (Each other family's round trip: tests/distributed/test_family_checkpoints.py.)"""
    root = tmp_path_factory.mktemp("convert")
    hf_dir = family_model_dir(root / "qwen2", "qwen2", tied=True, layers=4)  # PP=2: two layers per stage
    ckpt = str(root / "qwen2-ckpt")
    assert main(["from-hf", "--hf", hf_dir, "--out", ckpt, "--tp", "2", "--pp", "2"]) == 0
    return hf_dir, ckpt


def hf_tensors(folder) -> dict:
    tensors = {}
    for file in glob.glob(f"{folder}/*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def logits(folder, input_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits


def test_checkpoint_is_self_contained(converted):
    hf_dir, ckpt = converted
    metadata = json.load(open(os.path.join(ckpt, "rl_megatron_checkpoint.json")))
    assert metadata["source_layout"]["tp"] == 2 and metadata["source_layout"]["pp"] == 2
    assert metadata["dtype"] == "float32" and metadata["model_type"] == "qwen2"
    assert stored_hf_config(ckpt) == json.load(open(os.path.join(hf_dir, "config.json")))
    assert os.path.isfile(os.path.join(ckpt, "generation_config.json"))
    assert not os.path.exists(ckpt + ".incomplete")


# Loaded at a layout other than the saved TP2 x PP2: dist-checkpoint resharding on the way back.
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_round_trip_is_bitwise_and_runs_as_the_original(converted, tmp_path, tp, pp):
    hf_dir, ckpt = converted
    out = str(tmp_path / "hf")
    assert main(["to-hf", "--ckpt", ckpt, "--out", out, "--tp", str(tp), "--pp", str(pp)]) == 0
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert set(exported) == set(original)  # tied: no lm_head, in both
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(original)
    assert os.path.isfile(os.path.join(out, "generation_config.json"))
    input_ids = torch.randint(3, 18, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(out, input_ids), logits(hf_dir, input_ids))


def test_to_hf_in_bf16(converted, tmp_path):
    hf_dir, ckpt = converted
    out = str(tmp_path / "hf")
    assert main(["to-hf", "--ckpt", ckpt, "--out", out, "--dtype", "bf16"]) == 0
    exported = hf_tensors(out)
    for name, tensor in hf_tensors(hf_dir).items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


def test_config_mismatch_names_the_field(converted):
    _, ckpt = converted
    hf = stored_hf_config(ckpt)
    with pytest.raises(CheckpointError, match=r"num_attention_heads: checkpoint 2, model 4"):
        check_checkpoint(ckpt, dict(hf, num_attention_heads=4, head_dim=32))
    with pytest.raises(CheckpointError, match=r"rope_theta: checkpoint .*; vocab_size: checkpoint 18, model 20"):
        check_checkpoint(ckpt, dict(hf, vocab_size=20, rope_theta=1.0))


def _load_into_model_of(hf: dict, ckpt: str, dtype: str = "float32") -> dict:
    from rl_megatron.checkpoint import load_checkpoint_into
    from rl_megatron.models.gpt import build_gpt_chunks

    chunks = build_gpt_chunks(hf, dtype, 1)  # no vocabulary padding, unlike the saved 128 x TP
    load_checkpoint_into(chunks, ckpt, hf)
    return {name: param.detach().clone() for name, param in chunks[0].named_parameters()}


def test_loader_casts_to_the_model_dtype(converted):
    hf_dir, ckpt = converted
    params = run_distributed(_load_into_model_of, 1, args=(stored_hf_config(ckpt), ckpt, "bfloat16"))[0]
    original = hf_tensors(hf_dir)
    assert torch.equal(params["embedding.word_embeddings.weight"], original["model.embed_tokens.weight"].bfloat16())
    assert torch.equal(params["decoder.layers.3.mlp.linear_fc2.weight"],
                       original["model.layers.3.mlp.down_proj.weight"].bfloat16())


def test_loader_refuses_a_model_of_another_config(converted):
    _, ckpt = converted
    wrong_vocab = dict(stored_hf_config(ckpt), vocab_size=20)
    with pytest.raises(RuntimeError, match=r"vocab_size: checkpoint 18, model 20"):
        run_distributed(_load_into_model_of, 1, args=(wrong_vocab, ckpt))


def _broken_copy(ckpt: str, tmp_path) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, copy)
    return copy


def to_hf_error(ckpt: str, tmp_path, capsys) -> str:
    assert main(["to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "out")]) == 2
    assert not os.path.exists(tmp_path / "out")
    return capsys.readouterr().err


def test_truncated_or_missing_shard_names_the_path(converted, tmp_path, capsys):
    ckpt = _broken_copy(converted[1], tmp_path)
    shard = sorted(glob.glob(f"{ckpt}/*.distcp"))[1]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    assert f"Shard file '{shard}' is truncated" in to_hf_error(ckpt, tmp_path, capsys)
    os.remove(shard)
    assert f"Shard file '{shard}' is missing" in to_hf_error(ckpt, tmp_path, capsys)


def test_missing_metadata_or_edited_config_names_the_path(converted, tmp_path, capsys):
    ckpt = _broken_copy(converted[1], tmp_path)
    config_file = os.path.join(ckpt, "config.json")
    config = json.load(open(config_file))
    json.dump(dict(config, hidden_size=128), open(config_file, "w"))
    error = to_hf_error(ckpt, tmp_path, capsys)
    assert f"'{config_file}' no longer describes the weights" in error and "hidden_size" in error
    os.remove(os.path.join(ckpt, "rl_megatron_checkpoint.json"))
    assert f"'{os.path.join(ckpt, 'rl_megatron_checkpoint.json')}' is missing" in to_hf_error(ckpt, tmp_path, capsys)


def test_from_hf_refuses_bad_inputs(converted, tmp_path, capsys):
    hf_dir, ckpt = converted
    assert main(["from-hf", "--hf", hf_dir, "--out", ckpt]) == 2
    assert f"'{ckpt}' already exists" in capsys.readouterr().err
    assert main(["from-hf", "--hf", hf_dir, "--out", str(tmp_path / "c"), "--pp", "3"]) == 2
    assert "--pp=3 must divide the model's 4 layers" in capsys.readouterr().err
    assert main(["from-hf", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")]) == 2
    assert "--hf=" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_help_shows_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"python -m rl_megatron.convert {command}" in capsys.readouterr().out


def _trainer_policy_weights(cfg) -> tuple[dict, bool]:
    """The policy's weights, and whether it built an optimizer."""
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, read_hf_config(cfg.model.path))
    return actor.hf_state_dict(), actor.optimizer is not None


def test_the_trainer_starts_from_a_converted_checkpoint(converted, tmp_path):
    """model.checkpoint: the policy's shards come from the Megatron checkpoint (here at another layout than it was
    saved in); model.path, stripped of its weights, gives only the config and tokenizer. Here for a validation-only
    run (trainer.val_only), whose policy builds no optimizer state."""
    from rl_megatron.preflight import load_config

    hf_dir, ckpt = converted
    no_weights = shutil.copytree(hf_dir, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = load_config("configs/demo_cpu.yaml", [f"model.path={no_weights}", "model.random_init=false",
                                                f"model.checkpoint={ckpt}", "trainer.val_only=true"])
    state, has_optimizer = run_distributed(_trainer_policy_weights, 2, tp=2, args=(cfg,))[0]
    assert not has_optimizer
    original = hf_tensors(hf_dir)
    assert state.keys() == original.keys()
    assert all(torch.equal(state[name], original[name]) for name in original)


# vLLM loading an exported folder in CI: DeepSeek-V3's, tests/distributed/test_family_checkpoints.py.
@pytest.mark.slow
def test_exported_folder_loads_in_vllm(converted, tmp_path):
    """The to-hf folder as a vLLM user loads it (its own safetensors, not the trainer's sync): vLLM's greedy
    answers equal transformers' on the original model."""
    from transformers import AutoModelForCausalLM

    hf_dir, ckpt = converted
    out = str(tmp_path / "hf")
    assert main(["to-hf", "--ckpt", ckpt, "--out", out]) == 0
    prompts, new_tokens = [[1, 5, 6, 7], [1, 9, 3, 3, 4]], 5
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), prompts, new_tokens)
    assert run_distributed(vllm_greedy, 1, args=(out, prompts, new_tokens))[0] == expected
