"""Reward for the single-digit addition demo: the response must open with the exact integer."""
from rl_megatron.rewards import register


@register("arithmetic")
def compute_score(solution_str: str, ground_truth: str, score: float = 1.0) -> float:
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str) or not ground_truth:
        return 0.0
    response = solution_str.lstrip(" ")
    if not response.startswith(ground_truth):
        return 0.0
    # "35" must not count as the answer "3"; the end of the response or any non-digit is fine.
    next_char = response[len(ground_truth) : len(ground_truth) + 1]
    return 0.0 if next_char.isdigit() else score
