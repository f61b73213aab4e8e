"""`python -m rl_megatron.doctor` on a box with only torch, Megatron and transformers (no Ray, vLLM or Transformer
Engine: what a first single-GPU machine often has), in a process of its own where those do not import (its checks
with everything installed, in-process: tests/unit/test_doctor.py)."""
import json
import os
import subprocess
import sys

from helpers.runs import REPO

from rl_megatron.doctor import checks
from rl_megatron.doctor.report import PASS, SKIP

# Put first on PYTHONPATH, it makes the named packages unimportable in every process the doctor starts, as where
# they are not installed: `import` raises ModuleNotFoundError, importlib.util.find_spec returns None.
WITHOUT = """import sys
for name in ("ray", "vllm", "transformer_engine"):
    sys.modules[name] = None
"""


def doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "rl_megatron.doctor", "--config", "configs/demo_cpu.yaml", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def test_without_ray_vllm_and_te_one_device_runs_the_megatron_checks_and_skips_the_engines(tmp_path):
    """One device and the demo's config with the tiny Qwen3-MoE: the router, parity, update, offload and bench
    checks pass; the engine and cluster checks skip, each saying why; exit 0."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = doctor("model.path=configs/models/tiny-qwen3-moe-digits", "trainer.n_gpus_per_node=1",
                  "actor.tensor_model_parallel_size=1", "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {r["name"]: r for r in json.loads(done.stdout)}
    assert {name: r["status"] for name, r in results.items()} == {
        "devices": PASS, "stack: torch and vLLM": SKIP, "stack: Transformer Engine": SKIP, "stack: MoE router": PASS,
        "Megatron vs transformers (qwen3_moe)": PASS, "update": PASS, "offload round trip": PASS,
        "bench train": PASS, "collectives": SKIP, "host memory": PASS, "GPU memory": SKIP, "cycle": SKIP}
    assert results["cycle"]["figure"] == ("ray and vllm not installed, which the engine and cluster checks need "
                                          f"({checks.ENGINE_INSTALL})")
    assert results["stack: torch and vLLM"]["figure"].startswith("vllm not installed")
    assert "torch's GEMM" in results["stack: MoE router"]["figure"]  # te_general_gemm bound to None, as without TE
    assert results["collectives"]["figure"] == "one device: nothing to exchange"
