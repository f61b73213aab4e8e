"""`bench async --repeats R`: each mode's run of median samples/s is the one reported (rl_megatron/bench/async_rl.py),
so that one run slowed by the machine moves no figure."""
from rl_megatron.bench.async_rl import median_run


def test_the_run_of_median_samples_per_s_is_reported_whole():
    runs = [{"samples_per_s": 212.0, "step_s": 1.2}, {"samples_per_s": 114.0, "step_s": 2.2},
            {"samples_per_s": 191.0, "step_s": 1.3}]
    assert median_run(runs) is runs[2]  # its other figures come with it, from the same run
    assert median_run(runs[:1]) is runs[0]
    # An even count: the lower of the middle two, a run that happened rather than a mean of two.
    assert median_run(runs + [{"samples_per_s": 300.0, "step_s": 0.9}]) is runs[2]
