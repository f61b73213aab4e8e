"""What several test files share, imported as `helpers.<module>` (tests/ is on sys.path through tests/conftest.py):
parity (tiny HF models of each family and what transformers computes on them), ranks (what the distributed tests
run on each rank through run_distributed, and the checks they share), runs (the training command, run as a user
runs it), ray_debug (what the workers saw of Ray's debugger)."""
