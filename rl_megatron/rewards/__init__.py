"""Rule-based reward functions, looked up by each row's `data_source`.

The built-in scorers are registered under the data_source names that verl/TinyZero parquet files carry, and
keep the signatures of the verl functions users know: `compute_score(solution_str, ground_truth, ...)`.
The trainer scores through `rl_megatron.rewards.scorer.RewardScorer` (a process pool with a per-sample
timeout); `score` below is the plain in-process lookup.
"""
from collections.abc import Callable

# A scorer returns its score, or verl's dict {"score": ..., "acc": ..., ...} (DAPO's) with the accuracy on 0-1.
RewardFn = Callable[[str, object], float | dict]

REGISTRY: dict[str, RewardFn] = {}
# Data sources whose scorer expects the prompt followed by the response, as TinyZero decoded it (countdown
# looks for the "Assistant:" marker that ends the prompt); RewardScorer prepends the prompt for these.
READS_PROMPT: set[str] = set()
# Data sources whose scorer also takes the sample's extra_info (verl's compute_score(..., extra_info=...)): what a
# multi-turn rollout records there (tool calls, turns) besides the row's own extra_info.
READS_EXTRA_INFO: set[str] = set()
# The keyword arguments a data source's scorer takes from the reward config: {keyword: reward config key}.
KEYWORDS_FROM_CONFIG: dict[str, dict[str, str]] = {}


def register(*names: str, reads_prompt: bool = False, reads_extra_info: bool = False,
             from_config: dict[str, str] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register a scorer under one or more data_source names. `from_config` maps keyword arguments of the scorer
    to keys of the reward section, which RewardScorer passes to it: {"match": "gsm8k_match"} calls
    `scorer(solution_str, ground_truth, match=reward.gsm8k_match)`. With `reads_extra_info` the scorer is also
    called with `extra_info=` the sample's extra_info (None when it has none)."""
    if not names:
        raise TypeError("register() needs at least one data_source name")

    def add_to_registry(reward_fn: RewardFn) -> RewardFn:
        for name in names:
            REGISTRY[name] = reward_fn
            # A scorer registered again under a built-in's name (a user's own) gets only what it asks for.
            for asked, sources in ((reads_prompt, READS_PROMPT), (reads_extra_info, READS_EXTRA_INFO)):
                if asked:
                    sources.add(name)
                else:
                    sources.discard(name)
            if from_config:
                KEYWORDS_FROM_CONFIG[name] = dict(from_config)
            else:
                KEYWORDS_FROM_CONFIG.pop(name, None)
        return reward_fn

    return add_to_registry


def keywords_from_config(reward_cfg) -> dict[str, dict[str, object]]:
    """{data_source: {keyword: value}}: the arguments each registered scorer takes from `reward_cfg`."""
    return {source: {keyword: getattr(reward_cfg, key) for keyword, key in keys.items()}
            for source, keys in KEYWORDS_FROM_CONFIG.items()}


def unknown_source_error(data_source) -> KeyError:
    return KeyError(f"no reward function for data_source {data_source!r}; known sources: {sorted(REGISTRY)}. "
                    "Register one with @rl_megatron.rewards.register, or set reward.custom_fn.")


def score(data_source: str, solution_str: str, ground_truth, extra_info=None, **keywords) -> float | dict:
    """The registered scorer's result (a score, or a dict with "score" and "acc"), with its defaults (the match modes' "exact": verl's scores) unless `keywords`
    set them; a scorer registered with reads_extra_info also gets `extra_info`."""
    if data_source not in REGISTRY:
        raise unknown_source_error(data_source)
    if data_source in READS_EXTRA_INFO:
        keywords["extra_info"] = extra_info
    return REGISTRY[data_source](solution_str, ground_truth, **keywords)


# Imported last so their @register runs against the REGISTRY defined above.
from rl_megatron.rewards import arithmetic, countdown, gsm8k, lookup, math, math_dapo  # noqa: E402,F401
