"""Benchmarks of the hot paths (`python -m rl_megatron.bench NAME --json`): each figure with its limit measured
in the same run."""
