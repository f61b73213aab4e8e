"""One CUDA GPU: MoE routing replay R3 on a tiny Qwen3-MoE. The old log-prob, reference and update passes route
every token through the given experts, their log-probs are transformers' forced through the same experts, and
moe/routing_agreement counts the routers' own choices (tests/helpers/routing.py: the checks the gloo test makes,
with the GPU's tolerances: TE may run float32 GEMMs in TF32)."""
import pytest
import torch

from helpers.routing import check_r3_passes
from rl_megatron.workers.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def test_r3_replays_the_given_experts_on_cuda(tmp_path):
    check_r3_passes(tmp_path, run_distributed, log_prob_tolerance=2e-3, agreement_tolerance=0.05, exact=False,
                    grad_tolerance=5e-3)
