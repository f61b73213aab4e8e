"""`python -m rl_megatron.doctor` where it fails fast (its entry point, `main(argv)`, called here), and its report and
verdicts. On a box with only torch, Megatron and transformers (no Ray, vLLM or Transformer Engine: what a first
single-GPU machine often has), in a process of its own: tests/process/test_doctor_without_engines.py; the whole run
with Ray and vLLM on CPU is in tests/e2e/test_launch_script.py, through `launch/train_3d.sh --check`."""
import json
import time
from types import SimpleNamespace

import pytest

from helpers.runs import REPO
from rl_megatron.preflight import load_config
from rl_megatron.doctor import checks, model_checks
from rl_megatron.doctor.__main__ import main
from rl_megatron.doctor.report import FAIL, PASS, SKIP, Result, exit_code, gb_per_s, guarded, table

@pytest.fixture
def doctor(monkeypatch, capsys):
    """`doctor(*args)`: `python -m rl_megatron.doctor --config configs/demo_cpu.yaml ARGS` as its entry point, called
    here from the repository's root; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(REPO)

    def run(*args):
        capsys.readouterr()
        code = main(["--config", "configs/demo_cpu.yaml", *args])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


def test_the_engine_checks_skip_naming_what_is_missing_and_the_install_command():
    assert checks.missing_modules(("json", "no_such_module_here")) == ["no_such_module_here"]
    assert checks.needs_engines("cycle", []) is None
    skipped = checks.needs_engines("cycle", ["vllm"])
    assert skipped.status == SKIP and skipped.figure.startswith("vllm not installed")
    assert "pip install -r requirements-gpu.txt" in skipped.figure


@pytest.mark.parametrize("result,status,fix_names", [
    (model_checks.router_result("qwen3_moe", 2, [2, 2, 2], True), PASS, ""),
    (model_checks.router_result("qwen3_moe", 2, [], False, "NameError: name 'te_general_gemm' is not defined"), FAIL,
     "te_general_gemm"),
    (model_checks.router_result("qwen3_moe", 2, [2, 1, 2], True), FAIL, "requirements-gpu.txt"),
    (model_checks.router_result("qwen3_moe", 2, [2, 2], False), FAIL, "requirements-gpu.txt"),
    (model_checks.parity_result("qwen2", 3e-5, 1e-4, [], 12), PASS, ""),
    (model_checks.parity_result("qwen2", 3e-3, 1e-4, [], 12), FAIL, "requirements-gpu.txt"),
    (model_checks.parity_result("qwen2", float("nan"), 1e-4, [], 12), FAIL, "requirements-gpu.txt"),
    (model_checks.parity_result("qwen2", 3e-5, 1e-4, ["lm_head.weight"], 12), FAIL, "requirements-gpu.txt"),
    (model_checks.update_result(0.5, 1e-3, 12, 12), PASS, ""),
    (model_checks.update_result(0.5, -1e-3, 12, 12), FAIL, "requirements-gpu.txt"),
    (model_checks.update_result(float("inf"), 1e-3, 12, 12), FAIL, "requirements-gpu.txt"),
    (model_checks.update_result(0.5, 1e-3, 0, 12), FAIL, "requirements-gpu.txt"),
    (model_checks.offload_result("shared_params", 1 << 20, 1 << 20, []), PASS, ""),
    (model_checks.offload_result("shared_params", 1 << 20, 1 << 20, ["rank 0: changed by the round trip"]), FAIL,
     "actor.offload=false"),
])
def test_the_one_device_checks_pass_only_within_their_bounds_and_fail_with_the_fix(result, status, fix_names):
    assert result.status == status and fix_names in result.fix and bool(result.fix) == (status == FAIL)


def test_too_few_devices_fails_first_naming_the_key_and_starts_nothing(doctor):
    start = time.perf_counter()
    done = doctor("trainer.n_gpus_per_node=64", "actor.micro_batch_size=4", "--json")
    assert done.returncode == 1, done.stderr
    [devices] = json.loads(done.stdout)  # nothing else runs in a shape the machine cannot hold
    assert devices["name"] == "devices" and devices["status"] == FAIL
    assert "needs 64 per node" in devices["figure"] and "trainer.n_gpus_per_node=64" in devices["fix"]
    assert time.perf_counter() - start < 60  # no Ray, no engine


def test_a_bad_config_is_one_error_line_and_exit_code_2(doctor):
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
