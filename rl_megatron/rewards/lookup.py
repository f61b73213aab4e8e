"""Reward of the tool-calling demo (data_source "lookup", rows from rl_megatron.data.lookup).

1 when the final answer (the last assistant message's text) is the row's secret digit; else CALL_CREDIT when the
sample called the `lookup` tool, the only way to learn the digit, and answered with a digit: a random policy guesses
the digit one time in ten whether it calls or not, so without this credit nothing would single out the call; else 0.
The credit needs a digit answer: crediting the call alone let the policy settle on calling and then answering
anything (every sample 0.2, no advantage left to learn the copy from).
"""
from numbers import Real

from rl_megatron.rewards import register

CALL_CREDIT = 0.2


@register("lookup", reads_extra_info=True)
def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    if isinstance(ground_truth, str) and ground_truth and isinstance(solution_str, str) \
            and solution_str.strip() == ground_truth:
        return 1.0
    answered_a_digit = isinstance(solution_str, str) and len(solution_str.strip()) == 1 and solution_str.strip().isdigit()
    return CALL_CREDIT if answered_a_digit and called_lookup(extra_info) else 0.0


def called_lookup(extra_info) -> bool:
    """Whether the sample called `lookup`: extra_info["tool_stats"]["by_tool"]["lookup"] > 0, as the multi-turn
    rollout records it; False when extra_info does not hold that number (a single-turn sample, a malformed record)."""
    stats = extra_info.get("tool_stats") if isinstance(extra_info, dict) else None
    by_tool = stats.get("by_tool") if isinstance(stats, dict) else None
    calls = by_tool.get("lookup", 0) if isinstance(by_tool, dict) else 0
    return isinstance(calls, Real) and calls > 0
