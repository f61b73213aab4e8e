"""Loading the user's own scorer from `reward.custom_fn`.

The spec is `package.module:function` (imported like any module) or `path/to/file.py:function` (loaded from
the file, as verl's custom_reward_function.path does). The function is called for every sample as
`fn(data_source, solution_str, ground_truth, extra_info)` - verl's custom reward signature - and returns a
number (or a dict with a "score" entry). To reuse a built-in scorer for some sources, call
`rl_megatron.rewards.score(data_source, solution_str, ground_truth, extra_info)` from it.
"""
from collections.abc import Callable

from rl_megatron.plugins import load_callable

CustomRewardFn = Callable[[str, str, object, object], float]
KEY = "reward.custom_fn"


def load_custom_fn(spec: str) -> CustomRewardFn:
    """The function `spec` names; raises ConfigError naming reward.custom_fn and what was not found."""
    return load_callable(spec, KEY)
