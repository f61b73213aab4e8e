"""An OpenAI-compatible gateway in front of the rollout engines, so that an agent harness written for OpenAI's API
trains as it is (rollout.agent.function; docs/agentic-rl.md).

    openai_api.py  requests checked, responses and stream chunks built, errors in OpenAI's shape
    episode.py     one episode's calls as a token-faithful sample: the context extended call by call, or forked
    server.py      the HTTP server (aiohttp, served from the rollout's event loop), episodes by unguessable id
    loop.py        the user's function run once per episode (in rl_megatron/agent_workers.py's processes), as the
                   agent loop of the rollout's trajectories
"""
from rl_megatron.agents.gateway.episode import Episode
from rl_megatron.agents.gateway.loop import GatewayLoop, agent_row
from rl_megatron.agents.gateway.openai_api import ApiError, RunSampling
from rl_megatron.agents.gateway.server import GatewayServer

__all__ = ["ApiError", "Episode", "GatewayLoop", "GatewayServer", "RunSampling", "agent_row"]
