"""The model folder's pre-flight checks: the safetensors header parser, the weights every family's table needs
against what transformers writes, the critic's weights, the tokenizer's files and vocabulary, and the first prompt.
No processes: each runs in well under a second (the family folders in a few together)."""
import json
import os
import shutil
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.parity import family_model_dir
from helpers.runs import REPO
from safetensors.torch import save_file

from rl_megatron.config import ConfigError
from rl_megatron.models.hf_config import end_of_sequence_ids
from rl_megatron.preflight import load_config
from rl_megatron.data.section import check_first_prompt_encodes, resolve_data_section
from rl_megatron.config.schema import DataConfig
from rl_megatron.models import tokenizer as tokenizer_module
from rl_megatron.models.family import table_for
from rl_megatron.models.hf_weights import (SafetensorsFileError, TensorHeader, check_hf_weights,
                                           read_safetensors_header)
from rl_megatron.models.tokenizer import checked_tokenizer, load_tokenizer

DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
DEMO_PPO = os.path.join(REPO, "configs", "demo_cpu_ppo.yaml")


def hf_config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ the header parser


def write_raw(path, header: dict | bytes, data_bytes: int) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return str(path)


def test_header_of_a_good_file(tmp_path):
    path = str(tmp_path / "good.safetensors")
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, path, metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert set(header) == {"a", "b"}  # not __metadata__
    assert header["a"].dtype == "F32" and header["a"].shape == (2, 3) and header["a"].end - header["a"].begin == 24
    assert header["b"] == TensorHeader("BF16", (4,), header["b"].begin, header["b"].begin + 8)


@pytest.mark.parametrize("cut, problem", [
    (5, "it has 5 bytes, fewer than the 8"),  # not even the header length
    (20, "only 12 bytes follow it"),  # the header itself cut short
    (-1, "ends at byte"),  # the data section one byte short
])
def test_truncated_files_are_named_for_what_is_missing(tmp_path, cut, problem):
    path = str(tmp_path / "cut.safetensors")
    save_file({"a": torch.zeros(2, 3)}, path)
    os.truncate(path, cut if cut > 0 else os.path.getsize(path) + cut)
    with pytest.raises(SafetensorsFileError, match=problem):
        read_safetensors_header(path)


def test_header_length_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 10 ** 6) + b"{}")
    with pytest.raises(SafetensorsFileError, match="header length says 1000000 bytes, but only 2 bytes follow"):
        read_safetensors_header(str(path))


def test_offsets_past_the_end_of_the_file(tmp_path):
    path = write_raw(tmp_path / "x.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8)
    with pytest.raises(SafetensorsFileError, match="tensor 'a' ends at byte .* but the file has"):
        read_safetensors_header(path)


@pytest.mark.parametrize("header, problem", [
    (b"{not json", "its header is not JSON"),
    (b"[1, 2]", "its header is a JSON list, not an object"),
    ({"a": {"dtype": "F32", "shape": [4]}}, "the header entry of tensor 'a' is malformed"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}, "the header entry of tensor 'a' is malformed"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, r"needs 16 bytes, but its data_offsets give 12"),
])
def test_malformed_headers(tmp_path, header, problem):
    path = write_raw(tmp_path / "x.safetensors", header, 16)
    with pytest.raises(SafetensorsFileError, match=problem):
        read_safetensors_header(path)


# ------------------------------------------------------------------------- the weights a model needs


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("qwen3", True),
                                          ("qwen3_moe", False), ("mixtral", False)])
def test_the_tables_tensors_are_what_transformers_writes(tmp_path, family, tied):
    """The list the check (and the loader) takes from the weight table is exactly the folder save_pretrained
    writes: no name or shape of any family can drift apart from transformers' without this failing."""
    folder = family_model_dir(tmp_path / family, family, tied)
    hf = hf_config(folder)
    written = {name: tensor.shape for name, tensor in read_safetensors_header(f"{folder}/model.safetensors").items()}
    assert table_for(hf, hf["vocab_size"]).hf_tensors() == written
    check_hf_weights(folder, hf, "model.path")


def test_a_critic_needs_no_lm_head(tmp_path):
    folder = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    table = table_for(hf_config(folder), 18)
    assert set(table.hf_tensors()) - set(table.hf_tensors(output_layer=False)) == {"lm_head.weight"}


def test_the_critics_weights_are_checked_where_it_loads_them(tmp_path, tiny_model_dir):
    """The critic's trunk comes from critic.model_path unless model.random_init, even with model.checkpoint (which
    only gives the policy's weights)."""
    ok = load_config(DEMO_PPO, [f"model.path={tiny_model_dir}", "model.random_init=false"])
    assert ok.critic.enable and ok.critic.model_path == tiny_model_dir
    with pytest.raises(ConfigError, match=f"critic.model_path='{DEMO_MODEL}' has no \\*.safetensors weights"):
        load_config(DEMO_PPO, [f"model.path={tiny_model_dir}", "model.random_init=false",
                               f"critic.model_path={DEMO_MODEL}"])
    with pytest.raises(ConfigError, match=f"critic.model_path='{DEMO_MODEL}' has no \\*.safetensors weights"):
        load_config(DEMO_PPO, [f"model.path={DEMO_MODEL}", "model.random_init=false", f"model.checkpoint={tmp_path}"])
    load_config(DEMO_PPO, [f"model.path={DEMO_MODEL}", "model.random_init=false", f"model.checkpoint={tmp_path}",
                           f"critic.model_path={tiny_model_dir}"])
    with pytest.raises(ConfigError, match="critic.model_path='no/such/folder' is not a folder"):
        load_config(DEMO_PPO, [f"model.path={tiny_model_dir}", "model.random_init=false",
                               "critic.model_path=no/such/folder"])


def test_index_that_places_a_tensor_in_a_file_without_it(tmp_path, tiny_model_dir):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    weight_map = {"model.embed_tokens.weight": "other.safetensors", "model.norm.weight": "model.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"x": torch.zeros(1)}, str(folder / "other.safetensors"))
    with pytest.raises(ConfigError, match="places tensor 'model.embed_tokens.weight' in 'other.safetensors'"):
        check_hf_weights(str(folder), hf_config(folder), "model.path")


def test_pytorch_bin_weights_are_named(tmp_path):
    folder = shutil.copytree(DEMO_MODEL, tmp_path / "m")
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="It has pytorch_model.bin, which rl_megatron does not load"):
        check_hf_weights(str(folder), hf_config(folder), "model.path")


# ------------------------------------------------------------------------------------------ the tokenizer


def test_the_tokenizer_is_loaded_once_while_its_files_stay_the_same(tmp_path):
    folder = shutil.copytree(DEMO_MODEL, tmp_path / "m")
    first = checked_tokenizer(str(folder), hf_config(folder))
    assert load_tokenizer(str(folder)) is first
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # changed: loaded again
    assert load_tokenizer(str(folder)) is not first


def test_vocabulary_files_the_class_needs_without_tokenizer_json(tmp_path):
    """Qwen2's tokenizer builds from vocab.json and merges.txt when there is no tokenizer.json."""
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(os.path.join(DEMO_MODEL, "config.json"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer",
                                                             "eos_token": "<|endoftext|>"}))
    (folder / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0, "1": 1, "2": 2, "+": 3, "=": 4}))
    with pytest.raises(ConfigError, match=r"lacks tokenizer.json, merges.txt; transformers would build an EMPTY"):
        checked_tokenizer(str(folder), hf_config(folder))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    assert len(checked_tokenizer(str(folder), hf_config(folder))) == 5


class StubTokenizer:
    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    eos_token, pad_token = "<eos>", None

    def __init__(self, eos_token_id, pad_token_id=None):
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id

    def __len__(self):
        return 18


@pytest.mark.parametrize("eos, problem", [(None, "neither a padding nor an end-of-sequence token"),
                                          (20, "end-of-sequence token '<eos>' has id 20, outside its vocabulary")])
def test_end_of_sequence_and_padding_ids(monkeypatch, eos, problem):
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: StubTokenizer(eos))
    with pytest.raises(ConfigError, match=problem):
        checked_tokenizer(DEMO_MODEL, hf_config(DEMO_MODEL))


# ---------------------------------------------------------------------------------------- the first prompt


def test_a_tokenizer_that_encodes_the_prompt_to_nothing(tmp_path):
    from transformers import AutoTokenizer

    shutil.copy(os.path.join(DEMO_MODEL, "config.json"), tmp_path)
    empty = AutoTokenizer.from_pretrained(str(tmp_path))  # what transformers builds from no tokenizer files
    data = resolve_data_section(DataConfig())
    with pytest.raises(ConfigError, match="model.path='m': its tokenizer encodes the first prompt of "
                                          "data.task=arithmetic .* to no tokens"):
        check_first_prompt_encodes(data, empty, "m")


def test_the_first_prompt_of_the_train_files_is_read_alone(tmp_path):
    path = str(tmp_path / "train.parquet")
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+2="}],
             "reward_model": {"ground_truth": "3"}}] * 3
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = resolve_data_section(DataConfig(train_files=[path]))
    tokenizer = load_tokenizer(DEMO_MODEL)
    with pytest.raises(ConfigError, match=r"data.train_files\[0\]=.*chat messages but the tokenizer .* no chat "
                                          "template"):
        check_first_prompt_encodes(data, tokenizer, DEMO_MODEL)
    check_first_prompt_encodes(resolve_data_section(DataConfig(train_files=[path], apply_chat_template=False)),
                               tokenizer, DEMO_MODEL)


# ------------------------------------------------------------------------------------ where generation stops
def test_end_of_sequence_ids_take_lists_and_the_generation_config(tmp_path):
    """Llama 3.1 lists three ids in config.json; Qwen2.5-Instruct adds <|endoftext|> in generation_config.json."""
    folder = str(shutil.copytree(DEMO_MODEL, tmp_path / "model"))
    config = dict(hf_config(folder), eos_token_id=[2, 3])
    assert end_of_sequence_ids(folder, config) == [2, 3]  # generation_config.json's 2 comes once
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [4, 2]}, f)
    assert end_of_sequence_ids(folder, config) == [2, 3, 4]
    with pytest.raises(ConfigError, match=r"but 18 is not a token id below vocab_size=18"):
        end_of_sequence_ids(folder, dict(config, eos_token_id=18))
    os.remove(os.path.join(folder, "generation_config.json"))
    with pytest.raises(ConfigError, match=r"model.path='.*/model'.*but none is given"):
        end_of_sequence_ids(folder, {k: v for k, v in config.items() if k != "eos_token_id"})
