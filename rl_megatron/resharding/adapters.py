"""A LoRA policy's weight sync without merging: the engines hold the frozen base weights from the first sync (the
`Resharder`'s), and every sync after an update sends them the adapters alone, a few MB instead of the model, which
each engine loads as its LoRA adapter in place of the previous one (`RolloutEngine.load_adapter`).

verl and NeMo-RL hand vLLM the adapter tensors in memory by overriding its LoRA loader; here the engines load them
through their own path (vLLM's LoRARequest), from a PEFT adapter folder each worker rewrites (the one `convert
to-peft` writes: what vLLM serves is what users export). Each rank gathers the whole adapter of its model replica (TP, then
the pipeline stages): every engine shard loads the whole adapter and takes its own slice, as vLLM does."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rl_megatron.config.schema import LoraConfig
from rl_megatron.models.lora import adapter_tensors, peft_adapter_files


class AdapterSync:
    def __init__(self, chunks: list[torch.nn.Module], lora: LoraConfig, base_model: str, engine,
                 dtype: torch.dtype, verify: bool = False):
        """`chunks`: this rank's model chunks with their adapters; `engine`: this rank's engine, a
        `rl_megatron.rollout.engine.RolloutEngine` (started with the adapters' rank; not imported: the engines
        import resharding's sync targets, not the other way); `dtype`: the engine's; `verify`: after each sync, compare what the engine loaded with
        what was sent, bit for bit (resharding.verify)."""
        self.chunks, self.lora, self.base_model = chunks, lora, base_model
        self.engine, self.dtype, self.verify = engine, dtype, verify
        self.folder = tempfile.mkdtemp(prefix="rl_megatron_adapter_")

    def whole_adapter(self) -> dict[str, torch.Tensor]:
        """Every stage's adapters of this rank's model replica, whole over TP, in the engine's dtype, on the host
        (collective over the TP and pipeline groups)."""
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        mine = {name: t.detach().to("cpu", self.dtype) for name, t in adapter_tensors(self.chunks).items()}
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        return {name: tensor for stage in stages for name, tensor in stage.items()}

    @torch.no_grad()
    def sync(self) -> int:
        """The adapters as trained so far into this rank's engine; returns the bytes it received."""
        tensors = self.whole_adapter()
        peft_adapter_files(tensors, dataclasses.asdict(self.lora), self.base_model, self.folder)
        self.engine.load_adapter(self.folder)
        if self.verify:
            bad = self.engine.adapter_mismatches(tensors, self.lora.alpha / self.lora.rank)
            if bad:
                raise RuntimeError(f"LoRA adapter sync check failed for {len(bad)} tensor(s); first: {bad[0]} (the "
                                   f"engine's adapter from {self.folder} differs from what the trainer sent).")
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
