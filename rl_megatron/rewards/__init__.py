"""Rule-based reward functions, looked up by each row's `data_source`."""
from collections.abc import Callable

RewardFn = Callable[[str, str], float]

REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def add_to_registry(reward_fn: RewardFn) -> RewardFn:
        REGISTRY[name] = reward_fn
        return reward_fn

    return add_to_registry


def score(data_source: str, solution_str: str, ground_truth: str) -> float:
    if data_source not in REGISTRY:
        raise KeyError(
            f"no reward function for data_source {data_source!r}; known sources: {sorted(REGISTRY)}"
        )
    return REGISTRY[data_source](solution_str, ground_truth)


# Imported last so its @register runs against the REGISTRY defined above.
from rl_megatron.rewards import arithmetic  # noqa: E402,F401
