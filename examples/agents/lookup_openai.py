"""An agent written with the official `openai` client, trained as it is through rl_megatron's gateway
(configs/demo_cpu_agent.yaml, `make demo-agent`). It solves the tool demo's task: call `lookup`, then answer the
digit it returns. The tool runs here, in the agent, as in any harness; the policy behind `base_url` is the one being
trained, and every token it samples is recorded as sampled.

    rollout.agent.function: examples/agents/lookup_openai.py:lookup_agent
"""
import asyncio
import weakref

import openai

LOOKUP = {"type": "function",
          "function": {"name": "lookup", "description": "Look up the secret digit of this question.",
                       "parameters": {"type": "object", "properties": {}, "required": []}}}
MAX_CALLS = 3
_CLIENTS = weakref.WeakKeyDictionary()  # event loop -> its client


def new_client(base_url: str, cls: type[openai.AsyncOpenAI] = openai.AsyncOpenAI) -> openai.AsyncOpenAI:
    """The agent's client of the gateway. (Not on the `openai` package's aiohttp transport, though its calls cost
    less there: an aiohttp session left open when its event loop ends is reported as unclosed, and each rollout
    batch runs in an event loop of its own.) No time limit of its own (`timeout=None`): the episode has one,
    rollout.agent.timeout_s, and the client's default 5 s to connect failed episodes on a loaded machine."""
    return cls(base_url=base_url, api_key="unused", max_retries=0, timeout=None)


def client_for(base_url: str) -> openai.AsyncOpenAI:
    """A client of this episode's base URL. An AsyncOpenAI costs ~50 ms of CPU to create (its SSL context), more than
    a whole episode here: one per event loop, copied per episode (with_options shares its connections)."""
    loop = asyncio.get_running_loop()
    if loop not in _CLIENTS:
        _CLIENTS[loop] = new_client(base_url)
    return _CLIENTS[loop].with_options(base_url=base_url)


async def next_message(client: openai.AsyncOpenAI, messages: list[dict]):
    """The policy's next message, or None where the episode's length or turn limit ended the episode."""
    try:
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
    except openai.BadRequestError as error:
        if error.code in ("context_length_exceeded", "max_turns_exceeded"):
            return None
        raise
    return response.choices[0].message


async def lookup_agent(base_url: str, row: dict) -> None:
    """One episode. Its reward comes from the data source's scorer (rollout.agent.reward=scorer), which reads the
    last answer: return a number instead to give the reward here."""
    secret = row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]
    messages = list(row["prompt"])
    client = client_for(base_url)
    for _ in range(MAX_CALLS):
        message = await next_message(client, messages)
        if message is None:
            return None
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            reply = secret if call.function.name == "lookup" else f"Error: there is no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": reply})
    return None


async def compacting_agent(base_url: str, row: dict) -> None:
    """`lookup_agent` in a harness that compacts its history, as context-managing harnesses do: after a tool call it
    replaces the model's call and the tool's reply with one user message holding what the tool returned. Each call
    after that no longer extends what the episode sampled, so the episode forks: rl_megatron trains every segment,
    each in the context the engine read (docs/agentic-rl.md).

        rollout.agent.function: examples/agents/lookup_openai.py:compacting_agent
    """
    secret = row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["secret"]
    messages = list(row["prompt"])
    client = client_for(base_url)
    for _ in range(MAX_CALLS):
        message = await next_message(client, messages)
        if message is None or not message.tool_calls:
            return None
        messages = [*row["prompt"], {"role": "user", "content": secret}]  # the history, compacted
    return None
