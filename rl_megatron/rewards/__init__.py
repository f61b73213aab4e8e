"""Rule-based reward functions, looked up by each row's `data_source`.

The built-in scorers are registered under the data_source names that verl/TinyZero parquet files carry, and
keep the signatures of the verl functions users know: `compute_score(solution_str, ground_truth, ...)`.
The trainer scores through `rl_megatron.rewards.scorer.RewardScorer` (a process pool with a per-sample
timeout); `score` below is the plain in-process lookup.
"""
from collections.abc import Callable

from rl_megatron.registry import Registry

# A scorer returns its score, or verl's dict {"score": ..., "acc": ..., ...} (DAPO's) with the accuracy on 0-1.
RewardFn = Callable[[str, object], float | dict]

# Scorers by data source, with their traits: reads_prompt (the scorer expects the prompt followed by the response, as
# TinyZero decoded it: countdown looks for the "Assistant:" marker that ends the prompt; RewardScorer prepends the
# prompt), reads_extra_info (it also takes the sample's extra_info, verl's compute_score(..., extra_info=...): what a
# multi-turn rollout records there besides the row's own), from_config (the keyword arguments it takes from the
# reward config: {keyword: reward config key}).
SCORERS: Registry[RewardFn] = Registry(
    "reward scorer", "data_source", "register yours with @rl_megatron.rewards.register({name!r}) in a module listed "
    "in trainer.imports, or set reward.custom_fn=pkg.module:fn")


def register(*names: str, reads_prompt: bool = False, reads_extra_info: bool = False,
             from_config: dict[str, str] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register a scorer under one or more data_source names. `from_config` maps keyword arguments of the scorer
    to keys of the reward section, which RewardScorer passes to it: {"match": "gsm8k_match"} calls
    `scorer(solution_str, ground_truth, match=reward.gsm8k_match)`. With `reads_extra_info` the scorer is also
    called with `extra_info=` the sample's extra_info (None when it has none). A scorer registered again under a
    name (a user's own for a built-in's source) gets only what it asks for."""
    if not names:
        raise TypeError("register() needs at least one data_source name")

    def add_to_registry(reward_fn: RewardFn) -> RewardFn:
        for name in names:
            SCORERS.add(name, reward_fn, reads_prompt=reads_prompt, reads_extra_info=reads_extra_info,
                        from_config=dict(from_config or {}))
        return reward_fn

    return add_to_registry


def keywords_from_config(reward_cfg) -> dict[str, dict[str, object]]:
    """{data_source: {keyword: value}}: the arguments each registered scorer takes from `reward_cfg`."""
    return {source: {keyword: getattr(reward_cfg, key) for keyword, key in SCORERS.trait(source, "from_config").items()}
            for source in SCORERS.with_trait("from_config")}


def score(data_source: str, solution_str: str, ground_truth, extra_info=None, **keywords) -> float | dict:
    """The registered scorer's result (a score, or a dict with "score" and "acc"), with its defaults (the match modes' "exact": verl's scores) unless `keywords`
    set them; a scorer registered with reads_extra_info also gets `extra_info`."""
    if SCORERS.trait(data_source, "reads_extra_info"):
        keywords["extra_info"] = extra_info
    return SCORERS[data_source](solution_str, ground_truth, **keywords)


# Imported last so their @register runs against the SCORERS defined above.
from rl_megatron.rewards import arithmetic, countdown, gsm8k, lookup, math, math_dapo  # noqa: E402,F401
