"""The megatron-core bugs that every device hits are fixed by `platform.setup()` on a CUDA machine too, not only by
the CPU compatibility layer."""
import megatron.core.transformer.moe.moe_utils as moe_utils
import torch

from rl_megatron import platform


def test_setup_on_a_cuda_machine_lets_routers_run_without_transformer_engine(monkeypatch):
    # megatron-core 0.16.1 binds te_general_gemm only when TE imports: unbound, every router's forward raised
    # NameError on GPU machines without TE.
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(platform, "_applied", False)
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    platform.setup()

    tokens = torch.randn(5, 4, requires_grad=True)
    router_weight = torch.randn(3, 4, requires_grad=True)
    scores = moe_utils.router_gating_linear(tokens, router_weight, None, torch.float32)
    scores.sum().backward()
    torch.testing.assert_close(scores, tokens @ router_weight.T)
    torch.testing.assert_close(router_weight.grad, tokens.sum(0).expand(3, 4))
