"""The lookup agent of lookup_openai.py written with the OpenAI Agents SDK (`pip install openai-agents`), trained as
it is through rl_megatron's gateway: an `Agent` with a `function_tool`, run by `Runner.run` over an
`OpenAIChatCompletionsModel` whose client points at the episode's base URL. The SDK's tracing is off (it would
export every episode's spans to OpenAI's servers).

    rollout.agent.function: examples/agents/lookup_agents_sdk.py:lookup_agent
    rollout.agent.reward: scorer
"""
import openai
from agents import (Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool,
                    set_tracing_disabled)

MAX_CALLS = 3
set_tracing_disabled(True)


async def lookup_agent(base_url: str, row: dict) -> None:
    """One episode: the SDK calls the policy, runs `lookup` when asked and calls again, until the policy answers
    without a call. The reward comes from the lookup task's scorer, which reads the last answer."""
    secret = row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]

    @function_tool
    def lookup() -> str:
        """Look up the secret digit of this question."""
        return secret

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=None) as client:
        agent = Agent(name="lookup", tools=[lookup],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        try:
            await Runner.run(agent, list(row["prompt"]), max_turns=MAX_CALLS,
                             run_config=RunConfig(tracing_disabled=True))
        except MaxTurnsExceeded:  # the policy kept calling `lookup`: the episode ends with what it has
            return None
        except openai.BadRequestError as error:  # the episode's length or turn limit: it ends here
            if error.code in ("context_length_exceeded", "max_turns_exceeded"):
                return None
            raise
    return None
