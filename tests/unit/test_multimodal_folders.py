"""Qwen3.5's released (multimodal) folders: the language model taken out as the text-only folder transformers would
write (its logits on text those of the multimodal model), and a trained one put back with every other tensor
(the vision tower, the MTP layers), config.json and the side files as released; a config naming the multimodal
folder itself is refused with the command to run (`rl_megatron/models/multimodal.py`)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration)

from rl_megatron.convert import main as convert
from rl_megatron.errors import ConfigError
from rl_megatron.models.checks import check_model_layout
from rl_megatron.models.family import family_of
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.hf_weights import check_hf_weights
from rl_megatron.models.multimodal import language_model_config
from rl_megatron.models.tiny import build_tokenizer, family_config
from helpers.runs import REPO

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, temporal_patch_size=1,
              spatial_merge_size=1, num_position_embeddings=16)
MTP = {"mtp.fc.weight": torch.arange(12.0).reshape(3, 4)}  # as released folders hold them, beside the model's
TOKENS = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 6]])
# The released folders' model_type: their config and model classes, and their language model's model_type.
RELEASED = {"qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, "qwen3_5_moe_text"),
            "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, "qwen3_5_text")}


def weights(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


@pytest.fixture(scope="module", params=sorted(RELEASED))
def released(request, tmp_path_factory):
    """A tiny Qwen3_5(Moe)ForConditionalGeneration saved by transformers, with an MTP tensor added to its file."""
    folder = str(tmp_path_factory.mktemp("Qwen3.5-tiny"))
    config_class, model_class, text_type = RELEASED[request.param]
    text = family_config(text_type).to_dict()
    config = config_class(text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]),
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    [file] = [name for name in os.listdir(folder) if name.endswith(".safetensors")]
    save_file({**load_file(os.path.join(folder, file)), **MTP}, os.path.join(folder, file), metadata={"format": "pt"})
    return folder, model


@pytest.fixture(scope="module")
def text_folder(released, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out") / "Qwen3.5-tiny-text")
    assert convert(["language-model", "--hf", released[0], "--out", out]) == 0
    return out


def test_the_language_model_is_the_text_only_folder_transformers_reads_and_computes_alike(released, text_folder):
    folder, multimodal = released
    hf, text_type = read_hf_config(text_folder), type(multimodal.config.text_config).model_type
    assert hf["model_type"] == text_type and hf["architectures"] == [type(multimodal).__name__.replace(
        "ForConditionalGeneration", "ForCausalLM")]
    assert family_of(hf).model_type == text_type
    check_hf_weights(text_folder, hf, "model.path")  # every tensor the trainer loads, with its shape
    source, taken = weights(folder), weights(text_folder)
    assert not any(name.startswith(("model.visual.", "mtp.", "model.language_model.")) for name in taken)
    assert set(taken) == {name.replace("model.language_model.", "model.") for name in source
                          if name.startswith("model.language_model.") or name == "lm_head.weight"}
    for name, tensor in taken.items():
        original = source.get(name.replace("model.", "model.language_model.", 1), source.get(name))
        assert torch.equal(tensor, original), name
    text_model = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(text_model(TOKENS).logits, multimodal(input_ids=TOKENS).logits)
    assert os.path.isfile(os.path.join(text_folder, "tokenizer_config.json"))


def test_a_trained_language_model_goes_back_beside_the_released_tensors(released, text_folder, tmp_path):
    folder, _ = released
    trained = tmp_path / "trained"
    os.makedirs(trained)
    changed = {name: tensor * 2 + 1 for name, tensor in weights(text_folder).items()}
    save_file(changed, str(trained / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(text_folder, "config.json")) as f:
        (trained / "config.json").write_text(f.read())
    out = str(tmp_path / "Qwen3.5-tiny-rl")
    assert convert(["into-multimodal", "--hf", str(trained), "--source", folder, "--out", out]) == 0
    merged, source = weights(out), weights(folder)
    assert set(merged) == set(source)
    for name, tensor in source.items():
        text = name.replace("model.language_model.", "model.") if name.startswith("model.language_model.") else name
        expected = changed[text] if text in changed else tensor  # the vision tower and mtp.* as released
        assert torch.equal(merged[name], expected), name
    with open(os.path.join(folder, "config.json")) as a, open(os.path.join(out, "config.json")) as b:
        assert json.load(a) == json.load(b)
    model = type(released[1]).from_pretrained(out, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, changed["lm_head.weight"])


def test_wrong_folders_are_refused_naming_what_to_do(released, text_folder, tmp_path, capsys):
    folder, _ = released
    with pytest.raises(ConfigError, match=r"convert language-model --hf .* --out"):
        family_of(read_hf_config(folder))
    with pytest.raises(ConfigError, match=r"^model.path's config.json: .*multimodal folder"):  # what pre-flight says
        check_model_layout(read_hf_config(folder), ("actor.tensor_model_parallel_size", 1),
                           ("actor.pipeline_model_parallel_size", 1), ("actor.expert_model_parallel_size", 1))
    assert convert(["language-model", "--hf", text_folder, "--out", str(tmp_path / "x")]) == 2
    assert "is not a multimodal folder" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
    other = tmp_path / "other"
    os.makedirs(other)
    narrower = {name: tensor[..., :1].contiguous() for name, tensor in weights(text_folder).items()}
    save_file(narrower, str(other / "model.safetensors"), metadata={"format": "pt"})
    (other / "config.json").write_text(open(os.path.join(text_folder, "config.json")).read())
    assert convert(["into-multimodal", "--hf", str(other), "--source", folder, "--out", str(tmp_path / "y")]) == 2
    assert "they are not the same model" in capsys.readouterr().err and not os.path.exists(tmp_path / "y")


def test_the_shipped_language_model_config_is_the_released_folders():
    """configs/models/Qwen3.5-35B-A3B-text (what the recipe's dry run plans with) is what `convert language-model`
    writes from the released folder's config.json, shipped beside it."""
    shipped = os.path.join(REPO, "configs", "models")
    released = read_hf_config(os.path.join(shipped, "Qwen3.5-35B-A3B"))
    assert read_hf_config(os.path.join(shipped, "Qwen3.5-35B-A3B-text")) == language_model_config(released)
