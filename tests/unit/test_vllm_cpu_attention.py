"""A head size vLLM's CPU attention does not take is refused before anything starts, naming the config.json field
and the sizes that work; the sizes and dtypes mirrored in rl_megatron/rollout/vllm_cpu_attention.py are the installed
vLLM's own (read from its source: importing vLLM costs seconds)."""
import ast
import importlib.util
import json
import os
import shutil
import typing

import pytest
from helpers.runs import REPO

from rl_megatron.config import ConfigError, load
from rl_megatron.config.schema import ModelConfig
from rl_megatron.preflight import preflight, resolve
from rl_megatron.rollout.vllm_cpu_attention import (CPU_ATTENTION_HEAD_SIZES, CPU_MLA_HEAD_SIZES, check_cpu_attention,
                                                 engine_head_size)
from rl_megatron.preflight.dry_run import load_plan_config

DEMO = f"{REPO}/configs/demo_cpu.yaml"
VLLM = os.path.dirname(importlib.util.find_spec("vllm").origin)


def backend_class(relative_path: str, name: str) -> ast.ClassDef:
    with open(os.path.join(VLLM, relative_path)) as f:
        tree = ast.parse(f.read())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def supported_head_sizes(backend: ast.ClassDef) -> tuple:
    method = next(node for node in backend.body
                  if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes")
    [returned] = [node.value for node in ast.walk(method) if isinstance(node, ast.Return)]
    return tuple(ast.literal_eval(returned))


def supported_dtypes(backend: ast.ClassDef) -> set:
    assignment = next(node for node in backend.body if isinstance(node, ast.AnnAssign)
                      and node.target.id == "supported_dtypes")
    return {element.attr for element in assignment.value.elts}  # torch.float16, ...


def test_the_mirrored_sizes_and_dtypes_are_the_installed_vllms():
    cpu_attention = backend_class("v1/attention/backends/cpu_attn.py", "CPUAttentionBackend")
    assert supported_head_sizes(cpu_attention) == CPU_ATTENTION_HEAD_SIZES
    cpu_mla = backend_class("v1/attention/backends/mla/cpu_mla.py", "CPUMLABackend")
    assert supported_head_sizes(cpu_mla) == CPU_MLA_HEAD_SIZES
    # Every model.dtype the schema offers is one both backends take: no dtype check is needed beside the sizes.
    dtypes = set(typing.get_args(typing.get_type_hints(ModelConfig)["dtype"]))
    assert dtypes <= supported_dtypes(cpu_attention) and dtypes <= supported_dtypes(cpu_mla)


def tiny_folder(tmp_path, **changes) -> str:
    """The demo's tiny model folder with config.json fields changed (None removes one)."""
    folder = tmp_path / "tiny"
    shutil.copytree(f"{REPO}/configs/models/tiny-qwen2-digits", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(folder)


def demo(model_path: str):
    return resolve(load(DEMO, [f"model.path={model_path}", f"trainer.log_dir={os.path.dirname(model_path)}/runs"]))


@pytest.mark.parametrize("changes, field", [
    (dict(head_dim=16), "head_dim=16,"),
    (dict(head_dim=None, num_attention_heads=4), "hidden_size=64 / num_attention_heads=4 = 16,"),
])
def test_a_head_size_cpu_attention_lacks_is_refused_naming_the_field(tmp_path, changes, field):
    cfg = demo(tiny_folder(tmp_path, **changes))
    with pytest.raises(ConfigError) as refused:
        preflight(cfg, cuda=False)
    message = str(refused.value)
    assert f"model.path's config.json has {field}" in message and "CPU_ATTN" in message
    assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in message and "run on CUDA GPUs" in message
    preflight(cfg, cuda=True)  # CUDA engines have kernels for it: nothing to refuse here
    # A dry run on CPU slots refuses it as well, from config.json alone.
    with pytest.raises(ConfigError, match=field):
        load_plan_config(DEMO, [f"model.path={cfg.model.path}"], cuda=False)


def test_a_supported_head_size_passes(tmp_path):
    preflight(demo(tiny_folder(tmp_path)), cuda=False)  # the demo's 2 heads of 32
    preflight(demo(tiny_folder(tmp_path / "80", head_dim=80)), cuda=False)


def test_latent_attention_is_held_to_the_cpu_mla_kernel_size():
    with open(f"{REPO}/configs/models/tiny-deepseek-v3-digits/config.json") as f:
        hf = json.load(f)
    assert engine_head_size(hf) == (576, "kv_lora_rank=512 + qk_rope_head_dim=64 = 576")
    check_cpu_attention(hf, cuda=False)  # its config.json's head_dim (64) is not what vLLM's MLA backend gets
    narrow = dict(hf, kv_lora_rank=256)
    with pytest.raises(ConfigError, match=r"kv_lora_rank=256 \+ qk_rope_head_dim=64 = 320, .*CPU_MLA .*576"):
        check_cpu_attention(narrow, cuda=False)
    check_cpu_attention(narrow, cuda=True)
