"""The tool-calling demo's task: the answer of each row is a random digit that only the row's `lookup` tool knows.

The prompt ("secret?") is the same for every row, so the policy must call the tool in its first turn and copy the
digit from the tool's response in its second (rl_megatron.rewards.lookup pays for both). The digit reaches the tool
as verl's per-row tool state: extra_info["tools_kwargs"]["lookup"]["create_kwargs"]["secret"].
"""
import random

from rl_megatron.tools.base import Tool, ToolOutcome

NUM_ROWS = 1000
SEED = 0  # fixed: the same rows in every run, so that a saved loader position resumes over the same data


def lookup_row(secret: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": "secret?"}],
        "ground_truth": secret,
        "data_source": "lookup",
        "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": secret}}}},
    }


def lookup_rows() -> list[dict]:
    rng = random.Random(SEED)
    return [lookup_row(str(rng.randrange(10))) for _ in range(NUM_ROWS)]


class LookupTool(Tool):
    """The task's tool (configs/tools/lookup.yaml): takes no arguments, answers the row's secret digit."""

    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        secret = (state.get("create_kwargs") or {}).get("secret")
        if secret is None:
            return ToolOutcome.failure("Error: this row has no secret "
                                       "(extra_info.tools_kwargs.lookup.create_kwargs.secret)")
        return ToolOutcome(str(secret))
