"""Each model family's checkpoints both ways with `python -m rl_megatron.convert`: HF -> Megatron checkpoint (saved
at one layout) -> HF (loaded at another) is bitwise the original, and vLLM loads the exported folder and answers
greedily as transformers does on the original. (Each family's log-probs against transformers and its weights
resharded into vLLM engines: tests/distributed/test_megatron_parity.py, test_moe.py, test_resharding.py.)

In CI: DeepSeek-V3, whose export carries the most (latent attention, the routers' expert biases, shared experts,
a dense first layer), and gpt-oss (sinks, biases everywhere, experts stacked as its folders store them); the others
are `slow` (RL_MEGATRON_SLOW=1)."""
import glob

import pytest
import torch
from helpers.parity import family_model_dir, hf_model
from helpers.ranks import vllm_greedy
from safetensors.torch import load_file

from rl_megatron.convert import main
from rl_megatron.doctor.cycle import hf_greedy
from rl_megatron.models.tiny import LLAMA3_ROPE
from helpers.worlds import run_distributed


def hf_tensors(folder) -> dict:
    tensors = {}
    for file in glob.glob(f"{folder}/*.safetensors"):
        tensors.update(load_file(file))
    return tensors


# (family, its config fields, the layout the checkpoint is saved at, the layout it is loaded back at)
@pytest.mark.parametrize("family,extra,saved,loaded", [
    ("deepseek_v3", {}, ["--ep", "2"], ["--tp", "2"]),
    ("gpt_oss", {}, ["--ep", "2"], ["--tp", "2"]),  # its experts stacked in the folders; vLLM loads them itself
    pytest.param("qwen3_moe", {}, ["--ep", "2"], ["--tp", "2"], marks=pytest.mark.slow),
    pytest.param("deepseek_v2", {}, ["--pp", "2"], ["--tp", "2"], marks=pytest.mark.slow),
    pytest.param("glm4_moe", {}, ["--tp", "2", "--ep", "2"], [], marks=pytest.mark.slow),
    pytest.param("qwen2_moe", {"mlp_only_layers": [0]}, ["--ep", "2"], ["--pp", "2"], marks=pytest.mark.slow),
    pytest.param("llama", LLAMA3_ROPE, ["--tp", "2"], ["--pp", "2"], marks=pytest.mark.slow),
    pytest.param("mistral", {"sliding_window": 4}, ["--pp", "2"], ["--tp", "2"], marks=pytest.mark.slow),
])
def test_round_trip_is_bitwise_and_vllm_loads_the_export(tmp_path, family, extra, saved, loaded):
    hf_dir = family_model_dir(tmp_path / "hf", family, tied=False, **extra)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert main(["from-hf", "--hf", hf_dir, "--out", ckpt, *saved]) == 0
    assert main(["to-hf", "--ckpt", ckpt, "--out", out, *loaded]) == 0
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    prompts, new_tokens = [[1, 5, 6, 7], [1, 9, 3, 3, 4]], 5
    expected = hf_greedy(hf_model(hf_dir), prompts, new_tokens)
    assert run_distributed(vllm_greedy, 1, args=(out, prompts, new_tokens))[0] == expected
