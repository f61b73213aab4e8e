# Fresh CPU machine (Python 3.11, no GPU): `make demo` or `make test` install what they need first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rl_megatron-installed
# verl, whose reward scorers tests/unit/test_reward_verl_parity.py holds the project's to (docs/tasks-and-rewards.md).
VERL := 0.9.1
VERL_DIR := $(VENV)/verl-$(VERL)
PYTEST_ARGS ?=

.PHONY: install demo demo-tools demo-agent test test-fast clean

install: $(STAMP) $(VERL_DIR)/.installed

# Rebuilt only when the pins change: a second `make demo` installs nothing.
$(STAMP): setup.py requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so nothing below can pull the CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-cpu.txt
	# PyPI's builds of these link CUDA and break `transformers` imports on a CPU torch;
	# triton has no CPU backend. vLLM's text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# verl without its dependencies (they would pull a CUDA torch; its scorer files import only re and typing), in a
# folder of its own off sys.path, where the test finds it: its wheel also installs top-level `tests` and `scripts`
# packages, which would shadow this repository's tests/. A changed pin is a new folder, installed alone.
$(VERL_DIR)/.installed: | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(VERL_DIR) verl==$(VERL)
	touch $(VERL_DIR)/.installed

demo: install
	$(PY) -m rl_megatron.train --config configs/demo_cpu.yaml

demo-tools: install
	$(PY) -m rl_megatron.train --config configs/demo_cpu_tools.yaml

# The tool demo's task solved by your own kind of agent: an `openai` client through the gateway (docs/agentic-rl.md).
demo-agent: install
	$(PY) -m rl_megatron.train --config configs/demo_cpu_agent.yaml

# Every tier (tests/conftest.py describes them), on two workers; `make test PYTEST_ARGS='-m "not e2e"'` selects by
# tier.
test: install
	$(PY) -m pytest tests -n 2 --dist loadscope --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# The unit tier alone, in under 2 minutes: what to run after each change.
test-fast: install
	$(PY) -m pytest tests -m unit --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
