"""The console's last lines (rl_megatron/train.py): what this run trained, or that a finished checkpoint left
nothing to do, never both."""
import time

import pytest

from rl_megatron.preflight import load_config
from rl_megatron.train import _report
from rl_megatron.trainer.metrics import RunSummary

pytestmark = pytest.mark.unit


def report(capsys, tmp_path, history, resumed_at):
    cfg = load_config("configs/demo_cpu.yaml", [f"trainer.log_dir={tmp_path}"])
    assert _report(cfg, RunSummary.of(history, str(tmp_path / "run"), time.time(), None, resumed_at)) == 0
    return capsys.readouterr().out


def test_a_fresh_run_reports_its_steps(capsys, tmp_path):
    out = report(capsys, tmp_path, [0.1, 0.5, 0.9], 0)
    assert "Done: 3 steps in " in out and "Nothing to do" not in out and "Target mean reward 0.8 NOT reached" in out


def test_a_resumed_run_reports_the_steps_it_trained(capsys, tmp_path):
    out = report(capsys, tmp_path, [0.1, 0.5, 0.9], 1)
    assert "Done: steps 2-3 in " in out and "Nothing to do" not in out


def test_a_finished_checkpoint_leaves_nothing_to_do_and_no_done_line(capsys, tmp_path):
    out = report(capsys, tmp_path, [0.1, 0.5, 0.9], 3)
    assert "Nothing to do: the checkpoint at step 3 already finished this run" in out
    assert "Done:" not in out and "Target" not in out and "Metrics: " in out
