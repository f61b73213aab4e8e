"""`python -m rl_megatron.doctor`: a self-test of every path a run takes on its devices, before a long job is
queued (`report.py`: results; `checks.py`: devices, stack, collectives, memory; `model_checks.py`: Megatron on one
device, with `parity.py` against transformers and `offload_check.py`'s round trip, no Ray or vLLM needed;
`cycle.py`: a tiny model through the real workers and engines)."""
