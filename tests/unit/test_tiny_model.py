import json
import os

import pytest
from helpers.runs import REPO
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rl_megatron.models.tiny import TINY_FAMILIES, TOOLS, write_tiny_model

MODEL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
MODELS_DIR = os.path.join(REPO, "configs", "models")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def test_tokenizer_maps_each_character_to_its_id(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    # <bos>=1, then '0'..'9' = 4..13, '+'=14, '-'=15, '='=16, ' '=17
    assert tokenizer("3+4=")["input_ids"] == [1, 7, 14, 8, 16]
    assert tokenizer(" 9-0")["input_ids"] == [1, 17, 13, 15, 4]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 18


def test_tokenizer_decodes_back_to_text(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert tokenizer.decode([7]) == "3"
    text = "12+3= 15"
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_config_loads_with_the_demo_shape(tiny_dir):
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (18, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 32)
    assert not config.tie_word_embeddings
    assert sorted(os.listdir(tiny_dir)) == MODEL_FILES


def test_random_weights_are_seeded_and_loadable(tmp_path):
    first = write_tiny_model(str(tmp_path / "first"), with_weights=True, seed=3)
    second = write_tiny_model(str(tmp_path / "second"), with_weights=True, seed=3)
    model = AutoModelForCausalLM.from_pretrained(first)
    logits = model(torch.tensor([[1, 7, 14, 8, 16]])).logits
    assert logits.shape == (1, 5, 18)
    other = AutoModelForCausalLM.from_pretrained(second)
    for (name, weight), (_, other_weight) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(weight, other_weight), name


def test_moe_variant_is_a_qwen3_moe_of_the_same_width(tmp_path):
    config = AutoConfig.from_pretrained(write_tiny_model(str(tmp_path), moe=True))
    assert config.model_type == "qwen3_moe" and (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 64)


@pytest.mark.parametrize("file_name", MODEL_FILES)
@pytest.mark.parametrize("folder, options", [("tiny-qwen2-digits", {}), ("tiny-qwen3-moe-digits", {"moe": True}),
                                             ("tiny-qwen2-tools", {"vocabulary": TOOLS}),
                                             *((f"tiny-{name}-digits", {"family": name}) for name in TINY_FAMILIES)])
def test_committed_folder_matches_the_generator(tiny_dir, tmp_path, file_name, folder, options):
    generated = write_tiny_model(str(tmp_path), **options) if options else tiny_dir

    def load(folder):
        with open(os.path.join(folder, file_name)) as file:
            content = json.load(file)
        # Regenerating under another transformers release should not count as a difference.
        content.pop("transformers_version", None)
        return content

    assert load(os.path.join(MODELS_DIR, folder)) == load(generated)
