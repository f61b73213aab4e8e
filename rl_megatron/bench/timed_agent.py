"""`bench agent`'s agent: the example (examples/agents/lookup_openai.py:lookup_agent) with its client's calls timed.
It runs where the gateway runs agents (its worker processes, or the controller's event loop with
rollout.agent.num_workers=0) and hands each call's seconds (sent, answered and parsed, as the client saw them) back
as the episode's metrics, `call_0_s`, `call_1_s`, ... in order (the example calls one at a time). Light imports only:
a worker process loads this module."""
from __future__ import annotations

import asyncio
import contextvars
import os
import time

import openai

from rl_megatron.plugins import load_callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = load_callable(os.path.join(REPO, "examples", "agents", "lookup_openai.py") + ":lookup_agent", "bench agent")
SPEC = os.path.abspath(__file__) + ":timed_lookup_agent"
CALLS: contextvars.ContextVar[list[float]] = contextvars.ContextVar("bench_agent_calls")


class TimedClient(openai.AsyncOpenAI):
    """The agent's client, timing each request it completes for the episode it runs in; `with_options` copies keep
    the class."""

    async def request(self, *args, **kwargs):
        start = time.perf_counter()
        response = await super().request(*args, **kwargs)
        calls = CALLS.get(None)
        if calls is not None:
            calls.append(time.perf_counter() - start)
        return response


def call_seconds(metrics: dict[str, float]) -> list[float]:
    """The calls' seconds `timed_lookup_agent` returned, in order."""
    return [metrics[f"call_{index}_s"] for index in range(len(metrics)) if f"call_{index}_s" in metrics]


async def timed_lookup_agent(base_url: str, row: dict) -> dict[str, float]:
    """One episode of the example agent, its client a `TimedClient` made by the example's own `new_client` (the
    example keeps one client per event loop, `_CLIENTS`, which this fills before its first call in each)."""
    clients, new_client = EXAMPLE.__globals__["_CLIENTS"], EXAMPLE.__globals__["new_client"]
    loop = asyncio.get_running_loop()
    if loop not in clients:
        clients[loop] = new_client(base_url, cls=TimedClient)
    calls: list[float] = []
    CALLS.set(calls)  # in this episode's task: the example's calls are awaited in it
    await EXAMPLE(base_url, row)
    return {f"call_{index}_s": seconds for index, seconds in enumerate(calls)}
