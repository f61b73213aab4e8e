"""vLLM imported as an engine process imports it: `configure_engine_process` first, since vLLM reads part of its
environment at import. Importing this module is that preparation: the CPU fork server of `workers.spawn` preloads
it, so that every rank it forks starts with vLLM imported instead of importing it again (4-5 s of CPU on 2 cores)."""
from rl_megatron.rollout.vllm_engine import configure_engine_process

configure_engine_process()

import vllm.entrypoints.llm  # noqa: E402,F401  (what an engine's start imports)
