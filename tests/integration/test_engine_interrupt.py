"""A vLLM engine in this process, interrupted as a weight sync interrupts it (`VLLMEngine.interrupt`, partial
rollouts and streaming): each request cut off returns what it sampled so far, read from vLLM's record of the request,
as it would have sampled it uncut: its tokens, their log-probs and (the tiny Qwen3-MoE, moe.engine_routing's CPU
capture) the experts of every position it fed."""
import pytest
import torch

from rl_megatron.batch import SampleStatus
from rl_megatron.config.load import load
from rl_megatron.preflight.resolve import resolve
from rl_megatron.rollout.completions import TurnRequest
from rl_megatron.rollout.engine import engine_class

MAX_TOKENS = 12
CUT_AFTER = 5  # decode steps before the interrupt (the first is the prefill's)


@pytest.fixture(scope="module")
def engine():
    cfg = resolve(load("configs/moe/grpo_tiny_qwen3_moe_cpu.yaml", ["rollout.ignore_eos=true",
                                                                     f"rollout.max_tokens={MAX_TOKENS}"]))
    engine = engine_class(cfg.rollout.engine)(cfg.model.path, cfg.rollout, cfg.model.dtype, seed=0, routing=True)
    yield engine
    engine.close()


def requests(tag: str) -> list[TurnRequest]:
    """Prompts of several lengths (up to the config's 8 tokens), each request of its own seed, all decoding MAX_TOKENS
    (rollout.ignore_eos)."""
    return [TurnRequest(f"{tag}/{i}", [1 + (i + j) % 9 for j in range(3 + i)], seed=i, max_tokens=MAX_TOKENS,
                        temperature=1.0) for i in range(6)]


def test_an_interrupted_request_returns_what_it_sampled_as_it_would_have_sampled_it(engine):
    assert engine.serve(requests("cut"), max_steps=CUT_AFTER) == []  # nothing finishes in CUT_AFTER steps
    queued = TurnRequest("queued", [3, 4, 5], seed=9, max_tokens=MAX_TOKENS, temperature=1.0)
    assert engine.serve([queued], max_steps=0) == []  # added, never decoded
    cut = dict(engine.interrupt())
    assert engine.interrupt() == []  # nothing left running
    # The same requests uncut: the same steps in the same company, so the same numbers bit for bit.
    whole = {request_id.replace("whole", "cut"): completion
             for request_id, completion in engine.serve(requests("whole"))}
    assert set(cut) == {*whole, "queued"}
    assert (cut["queued"].response_ids, cut["queued"].log_probs, cut["queued"].routed_experts) == ([], [], None)
    assert cut["queued"].status == SampleStatus.ABORTED
    for request_id, completion in whole.items():
        part = cut[request_id]
        assert part.status == SampleStatus.ABORTED and len(completion.response_ids) == MAX_TOKENS
        assert part.response_ids == completion.response_ids[:CUT_AFTER]
        assert part.log_probs == completion.log_probs[:CUT_AFTER]
        # Every position fed: the prompt and the tokens sampled but the last.
        fed = len(requests("cut")[int(request_id.split("/")[1])].token_ids) + CUT_AFTER - 1
        assert part.routed_experts.shape[0] == fed
        assert torch.equal(torch.from_numpy(part.routed_experts), torch.from_numpy(completion.routed_experts[:fed]))
