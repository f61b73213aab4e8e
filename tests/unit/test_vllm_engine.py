"""The vLLM engine's set-up that CPU runs cannot show: the arguments a CUDA engine starts with, and a prefix-cache
reset that vLLM refuses (it only logs a warning)."""
import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_megatron.config.schema import RolloutConfig
from rl_megatron.models.family import family_of
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.rollout.vllm_engine import drop_prefix_cache, engine_arguments

DENSE = "configs/models/tiny-qwen2-digits"  # a CUDA engine reads its config.json: MoE models pin their kernels


def engine_args_fields() -> set[str]:
    """The fields of vLLM's EngineArgs, read from its source (importing vLLM takes seconds)."""
    [package] = importlib.util.find_spec("vllm").submodule_search_locations
    tree = ast.parse((Path(package) / "engine" / "arg_utils.py").read_text())
    [engine_args] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineArgs"]
    return {node.target.id for node in engine_args.body if isinstance(node, ast.AnnAssign)}


@pytest.mark.parametrize("cuda, mla", [(False, False), (False, True), (True, False), (True, True)])
def test_engines_schedule_one_step_at_a_time_on_every_device(cuda, mla):
    """On CUDA vLLM 0.32 turns async scheduling on unless told not to; `serve`/`interrupt` assume it is off."""
    args = engine_arguments(DENSE, RolloutConfig(max_model_len=64), "bfloat16", 0, None, "dummy", cuda=cuda, mla=mla,
                            group_timeout_s=None)
    assert args["async_scheduling"] is False
    assert set(args) <= engine_args_fields()
    assert ("gpu_memory_utilization" in args, args["enable_sleep_mode"], args["enforce_eager"]) == (cuda, cuda, not cuda)
    assert args.get("attention_backend") == ("CPU_MLA" if mla and not cuda else None)


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("folder", ["tiny-qwen3-next-digits", "tiny-qwen3-5-digits", "tiny-qwen3-5-moe-digits"])
def test_linear_attention_states_are_cached_by_prefix_only_where_prefill_is_chunked(cuda, folder):
    """vLLM caches Gated DeltaNet states by prefix only with chunked prefill (its start fails otherwise), which CPU
    engines go without; CUDA engines keep both. Every hybrid family's engines are told (the family's
    gated_delta_net, as `VLLMEngine` reads it)."""
    model_path = f"configs/models/{folder}"
    args = engine_arguments(model_path, RolloutConfig(max_model_len=64), "bfloat16", 0, None, "dummy", cuda=cuda,
                            mla=False, group_timeout_s=None,
                            linear_attention=family_of(read_hf_config(model_path)).gated_delta_net)
    assert args["enable_prefix_caching"] is cuda
    assert args.get("enable_chunked_prefill", True) is cuda


def test_a_refused_prefix_cache_reset_stops_the_weight_update():
    with pytest.raises(RuntimeError, match="could not reset its prefix cache.*old weights would be reused"):
        drop_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: False))
    drop_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: True))
