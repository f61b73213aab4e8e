"""Shared by the weight-sync checks (tests/integration on CPU, tests/gpu over NCCL): the doctor's cycle
(`rl_megatron.doctor.cycle`) on the tiny model, in the demo's layout with `overrides`; every check must hold."""
from rl_megatron.preflight import load_config
from rl_megatron.doctor.cycle import cycle_config, weight_cycle


def sync_config(model_dir: str, *overrides: str):
    return cycle_config(load_config("configs/demo_cpu.yaml", list(overrides)), model_dir)


def check_sync_puts_trainer_weights_into_engines(model_dir: str, *overrides: str, cpus: int = 2,
                                                 log_prob_tolerance: float = 1e-5) -> None:
    """Sync, compare every engine's weights and greedy output with the trainer's; one large update; again."""
    report = weight_cycle(sync_config(model_dir, *overrides), cpus)
    assert report.problems == []
    # The engine sampled from the distribution the trainer computes, to float32 rounding.
    assert report.max_log_prob_gap < log_prob_tolerance
