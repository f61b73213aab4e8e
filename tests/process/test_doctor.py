"""`python -m rl_megatron.doctor` where it fails fast (the whole run on CPU is in tests/e2e/test_launch_script.py,
through `launch/train_3d.sh --check`), and its report."""
import json
import subprocess
import sys
import time
from types import SimpleNamespace

from helpers.runs import REPO
from rl_megatron.config import load_config
from rl_megatron.doctor import checks
from rl_megatron.doctor.__main__ import guarded
from rl_megatron.doctor.report import FAIL, PASS, SKIP, Result, exit_code, gb_per_s, table


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "rl_megatron.doctor", "--config", "configs/demo_cpu.yaml", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_too_few_devices_fails_first_naming_the_key_and_starts_nothing():
    start = time.perf_counter()
    done = doctor("trainer.n_gpus_per_node=64", "actor.micro_batch_size=4", "--json")
    assert done.returncode == 1, done.stderr
    [devices] = json.loads(done.stdout)  # nothing else runs in a shape the machine cannot hold
    assert devices["name"] == "devices" and devices["status"] == FAIL
    assert "needs 64 per node" in devices["figure"] and "trainer.n_gpus_per_node=64" in devices["fix"]
    assert time.perf_counter() - start < 60  # no Ray, no engine


def test_a_bad_config_is_one_error_line_and_exit_code_2():
    done = doctor("actor.optim.lr=oops")
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "actor.optim.lr" in done.stderr


def test_the_report_shows_each_check_and_the_fix_and_fails_when_one_failed():
    results = [Result("devices", PASS, "2 GPU(s)"), Result("GPU memory", SKIP, "no CUDA"),
               Result("cycle", FAIL, "12 s", "set resharding.channel=process_group")]
    assert table(results).splitlines() == ["PASS  devices     2 GPU(s)", "SKIP  GPU memory  no CUDA",
                                           "FAIL  cycle       12 s", "                  fix: set "
                                           "resharding.channel=process_group"]
    assert exit_code(results) == 1 and exit_code(results[:2]) == 0
    assert gb_per_s(2 * 10**9, 0.5) == 4.0


def test_a_check_that_crashes_is_a_failure_naming_the_error_and_the_rest_still_runs():
    def engine_start():
        raise RuntimeError("Traceback ...\nCUDA error: invalid device ordinal")

    [result] = guarded("cycle", engine_start)
    assert result.status == FAIL and result.figure == "RuntimeError: CUDA error: invalid device ordinal"
    assert guarded("devices", lambda: Result("devices", PASS, "8 GPU(s)")) == [Result("devices", PASS, "8 GPU(s)")]


def test_gpu_memory_over_the_plan_is_a_failure_with_the_fix_not_a_crash(monkeypatch):
    """The plan refuses a config over a known GPU size; the doctor, which measures the GPUs, reports it as a FAIL
    (the same message: the figures and the keys to change). The GPUs are faked: 2 GiB each."""
    monkeypatch.setattr(checks.platform, "has_cuda", lambda: True)
    monkeypatch.setattr(checks.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(checks.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=2 << 30))
    cfg = load_config(f"{REPO}/configs/demo_cpu.yaml", [f"model.path={REPO}/configs/models/tiny-qwen2-digits",
                                                         "actor.max_tokens_per_micro_batch=1000000"])
    result = checks.gpu_memory(cfg)
    assert result.status == FAIL and "with activations, of 2.0 GiB" in result.figure
    assert "actor.max_tokens_per_micro_batch=1000000 lower" in result.fix
    assert checks.gpu_memory(load_config(f"{REPO}/configs/demo_cpu.yaml", [
        f"model.path={REPO}/configs/models/tiny-qwen2-digits"])).status == PASS
