"""The rollout engines (one per device or per TP group of devices): what one is (`engine.py`, rollout.engine names it),
vLLM's (`vllm_engine.py`), the controller's handle on them (`engines.py`) and the rollout functions over them."""
