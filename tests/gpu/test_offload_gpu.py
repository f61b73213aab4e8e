"""Offloading on CUDA: the actor's parameters and optimizer state to pinned host memory and back bitwise, gradients
dropped and re-zeroed, host buffers reused, and the next update equal to one without the round trip. Needs torch
with CUDA, megatron-core and transformers only (no vLLM or Ray).

    pytest tests/gpu/test_offload_gpu.py -m gpu -v -rA
"""
import pytest
import torch

from helpers.offload import (check_offload_frees_the_state_and_restores_it,
                             check_update_after_offload_equals_update_without, round_trips)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


@pytest.mark.parametrize("tp", [1, 2])
def test_offload_round_trip_on_gpus(tiny_model_dir, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs (has {torch.cuda.device_count()})")
    per_rank = round_trips(tiny_model_dir, tp, layouts=("private_params",))  # on GPU no parameter is shared
    check_offload_frees_the_state_and_restores_it(per_rank, "private_params")
    check_update_after_offload_equals_update_without(per_rank, "private_params")
