"""`launch/train_3d.sh --dry-run` as on a laptop with a fresh clone: no data prepared, no model downloaded. Every GPU
recipe's plan prints from the config and the model's config.json alone (the one configs/models ships for a model
folder that is not there); the data files, the tokenizer and the weights are left to the launch, which still
checks them. tests/process/test_dry_run_fresh_clone.py runs the script itself on a copy of the clone."""
import os
import re
import shutil
import subprocess

import pytest
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.planning import build_plan
from rl_megatron.launch.__main__ import plan_node
from rl_megatron.preflight import load_config
from rl_megatron.preflight.dry_run import SHIPPED_MODELS, load_plan_config, shipped_models

LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "GPUS_PER_NODE", "GPU_MEMORY_GIB", "CUDA_VISIBLE_DEVICES",
                    "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "RAY_DEBUG")


def clone_files(under: str) -> list[str]:
    """The files under `under` a clone of this checkout has once it is committed (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", under], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return [path for path in listed.split("\0") if path and os.path.isfile(os.path.join(REPO, path))]


def gpu_recipes() -> list[str]:
    """The configs whose model.path is left for the user to set (`???`): the GPU recipes."""
    return sorted(path.removeprefix("configs/").removesuffix(".yaml") for path in clone_files("configs")
                  if path.endswith(".yaml") and re.search(r"^\s+path: \?\?\?", open(os.path.join(REPO, path)).read(),
                                                          re.MULTILINE))


def header_model(recipe: str) -> str:
    """The model folder a recipe's header tells users to pass (`model.path=/path/to/NAME`)."""
    with open(f"{REPO}/configs/{recipe}.yaml") as f:
        return re.search(r"model\.path=/path/to/([\w.\-]+)", f.read()).group(1)


# Recipes whose header names a model without a shipped config.json, and the model planned instead.
PLANNED_WITH = {
    # Qwen3-30B-A3B is post-trained from the Base model: the same shapes, so the same plan.
    "gspo_qwen3_30b_a3b_math": "Qwen3-30B-A3B",
    # The header's bf16 copy of the released FP8 weights has the released config.json but for quantization_config,
    # which the plan does not read (it counts in model.dtype).
    "deepseek_v3/grpo_deepseek_v3_math": "DeepSeek-V3",
}
NOT_SHIPPED = {"grpo_glm4_5_air_math": "no published config.json of GLM-4.5-Air was found to ship"}
# Recipes for GPUs other than an 80 GB H100, planned with GPU_MEMORY_GIB as their headers say.
GPU_MEMORY_GIB = {"grpo_qwen3_next_80b_a3b_math": "140"}  # H200s: an engine's half of the weights is 74 GiB


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """A working directory holding the clone's configs/ and nothing else: no data/, no model folders."""
    for path in clone_files("configs"):
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(REPO, path), tmp_path / path)
    monkeypatch.chdir(tmp_path)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.parametrize("recipe", [pytest.param(recipe, marks=pytest.mark.skip(NOT_SHIPPED[recipe]))
                                    if recipe in NOT_SHIPPED else recipe for recipe in gpu_recipes()])
def test_every_recipe_plans_from_a_fresh_clone(fresh_clone, monkeypatch, recipe):
    model = PLANNED_WITH.get(recipe) or header_model(recipe)
    if recipe in GPU_MEMORY_GIB:
        monkeypatch.setenv("GPU_MEMORY_GIB", GPU_MEMORY_GIB[recipe])
        assert f"GPU_MEMORY_GIB={GPU_MEMORY_GIB[recipe]} " in open(f"{REPO}/configs/{recipe}.yaml").read()
    overrides = [f"model.path=/models/{model}"]
    config = f"configs/{recipe}.yaml"
    plan = build_plan(load_plan_config(config, overrides).cfg)  # the environment the launch needs: this plan's
    for name, value in {"NNODES": plan.nnodes, "NODE_RANK": 0, "MASTER_ADDR": "node0",
                        "GPUS_PER_NODE": plan.gpus_per_node}.items():
        monkeypatch.setenv(name, str(value))
    text = plan_node(config, overrides, dry_run=True).plan_text
    print(f"--- {recipe}\n{text}")
    assert f"Cluster plan: {plan.nnodes} node(s), {plan.total_gpus} GPUs" in text
    assert (f"Model: /models/{model} (not on this machine: planned with configs/models/{model}/config.json, shipped "
            "with rl_megatron)") in text
    assert "the data files, the tokenizer and the weights are checked when the run launches" in text
    assert not os.path.exists("data") and "WARNING" not in text
    with pytest.raises(ConfigError):  # the launch itself still needs the model folder (and the data)
        load_config(config, overrides)


def test_recipe_headers_name_shipped_models_or_say_what_stands_in():
    """Each GPU recipe's header model has a shipped config.json, or PLANNED_WITH / NOT_SHIPPED says why not."""
    shipped = set(shipped_models())
    for recipe in gpu_recipes():
        assert header_model(recipe) in shipped or recipe in PLANNED_WITH or recipe in NOT_SHIPPED, recipe
    assert set(PLANNED_WITH.values()) <= shipped and set(PLANNED_WITH) | set(NOT_SHIPPED) <= set(gpu_recipes())
    clone = set(clone_files("configs/models"))  # shipped means in a clone: tracked or new, never ignored
    assert {f"configs/models/{name}/config.json" for name in shipped} <= clone


def test_a_dry_run_reads_no_data_and_no_weights_but_the_launch_does(tmp_path):
    """Missing data files and a folder without weights: the dry run plans, the launch's check refuses."""
    overrides = [f"model.path={REPO}/configs/models/tiny-qwen2-digits", "model.random_init=false", "data.task=null",
                 f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files=[{tmp_path}/val.parquet]",
                 f"trainer.log_dir={tmp_path}"]
    checked = load_plan_config(f"{REPO}/configs/demo_cpu.yaml", overrides, cuda=False)
    assert checked.stand_ins == {} and checked.model == f"{REPO}/configs/models/tiny-qwen2-digits"
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(f"{REPO}/configs/demo_cpu.yaml", overrides)


def test_a_model_neither_here_nor_shipped_names_what_to_do(fresh_clone):
    with pytest.raises(ConfigError) as refused:
        load_plan_config("configs/grpo_llama3_1_8b_math.yaml", ["model.path=/models/My-Llama"])
    message = str(refused.value)
    assert "model.path='/models/My-Llama' is not on this machine" in message and "Llama-3.1-8B-Instruct" in message
    assert "point model.path at it" in message
    # The folder's name picks the shipped config.json whatever its case; the path before it does not matter.
    assert load_plan_config("configs/grpo_llama3_1_8b_math.yaml",
                            ["model.path=/data/weights/llama-3.1-8b-instruct/"]).stand_ins == {
        "/data/weights/llama-3.1-8b-instruct/": str(SHIPPED_MODELS / "Llama-3.1-8B-Instruct")}
