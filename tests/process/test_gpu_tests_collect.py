"""tests/gpu where Ray, vLLM and Transformer Engine are not installed (and, here, CUDA is absent): every module
imports and every test skips, saying why; none errors at collection, before its skip markers are read."""
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.runs import REPO

ROOT = Path(REPO)
NOT_INSTALLED = ("ray", "vllm", "transformer_engine")


def test_gpu_tests_collect_and_skip_without_ray_vllm_or_transformer_engine(tmp_path):
    # A plugin that pytest loads before any conftest or test module: from then on these import as if not installed
    # (ModuleNotFoundError; importlib.util.find_spec finds nothing).
    (tmp_path / "not_installed.py").write_text(f"import sys\n\nsys.modules.update(dict.fromkeys({NOT_INSTALLED!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-p", "not_installed", "-p", "no:cacheprovider",
                           "-q", "-rs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    summary = done.stdout.strip().splitlines()[-1]  # e.g. "19 skipped, 14 warnings in 6.15s"
    assert "skipped" in summary and not re.search(r"passed|failed|error|xfail|xpass", summary), out
    skipped = dict(re.findall(r"^SKIPPED \[\d+\] (tests/gpu/\w+\.py):\d+: (.+)$", done.stdout, re.MULTILINE))
    assert set(skipped) == {f"tests/gpu/{path.name}" for path in (ROOT / "tests" / "gpu").glob("test_*.py")}, out
