"""Rule-based reward functions, looked up by each row's `data_source`.

The built-in scorers are registered under the data_source names that verl/TinyZero parquet files carry, and
keep the signatures of the verl functions users know: `compute_score(solution_str, ground_truth, ...)`.
The trainer scores through `rl_megatron.rewards.scorer.RewardScorer` (a process pool with a per-sample
timeout); `score` below is the plain in-process lookup.
"""
from collections.abc import Callable

RewardFn = Callable[[str, object], float]

# How the gsm8k and MATH scorers compare answers (reward.gsm8k_match, reward.math_match): "exact" gives verl's
# scores, "numeric" also accepts equal values written differently.
MATCH_MODES = ("exact", "numeric")

REGISTRY: dict[str, RewardFn] = {}
# Data sources whose scorer expects the prompt followed by the response, as TinyZero decoded it (countdown
# looks for the "Assistant:" marker that ends the prompt); RewardScorer prepends the prompt for these.
READS_PROMPT: set[str] = set()
# The keyword arguments a data source's scorer takes from the reward config: {keyword: reward config key}.
KEYWORDS_FROM_CONFIG: dict[str, dict[str, str]] = {}


def register(*names: str, reads_prompt: bool = False,
             from_config: dict[str, str] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register a scorer under one or more data_source names. `from_config` maps keyword arguments of the scorer
    to keys of the reward section, which RewardScorer passes to it: {"match": "gsm8k_match"} calls
    `scorer(solution_str, ground_truth, match=reward.gsm8k_match)`."""
    if not names:
        raise TypeError("register() needs at least one data_source name")

    def add_to_registry(reward_fn: RewardFn) -> RewardFn:
        for name in names:
            REGISTRY[name] = reward_fn
            if reads_prompt:
                READS_PROMPT.add(name)
            else:
                READS_PROMPT.discard(name)
            # A scorer registered again under a built-in's name (a user's own) gets only the keywords it asks for.
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


def score(data_source: str, solution_str: str, ground_truth) -> float:
    """The registered scorer's score, with its defaults (the match modes' "exact": verl's scores)."""
    if data_source not in REGISTRY:
        raise unknown_source_error(data_source)
    return REGISTRY[data_source](solution_str, ground_truth)


# Imported last so their @register runs against the REGISTRY defined above.
from rl_megatron.rewards import arithmetic, countdown, gsm8k, math, math_dapo  # noqa: E402,F401
