"""The vLLM rollout engine (one per device or per TP group of devices) and its per-request sampling seeds."""
