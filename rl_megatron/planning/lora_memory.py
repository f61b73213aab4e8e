"""The parameters a LoRA actor holds per rank (actor.lora, models/lora.py), for the memory plan: the adapters the
optimizer trains, and the merged copies of the adapted weights that the weight sync sends (planning/memory.py's
"LoRA actor")."""
from __future__ import annotations

import math

from rl_megatron.models.family import table_for
from rl_megatron.models.pipeline_stages import PipelineSplit, StageLayers
from rl_megatron.models.weight_layouts import adapted_parts, is_row_parallel
from rl_megatron.models.weight_tables import ADAPTABLE_LINEARS, padded_vocab_size


def lora_parameters(hf: dict, modules: tuple[str, ...], rank: int, tp: int = 1, pp: int = 1, vpp: int = 1,
                    stages: StageLayers = StageLayers(), transformer_engine: bool = False) -> tuple[int, int]:
    """(adapter parameters, merged-weight elements) of one rank on its fullest pipeline stage with LoRA adapters of
    rank `rank` on the HF `modules` (models/lora.py): per adapted projection A [r, in] (split over TP in a
    row-parallel layer) and B [out, r] (split over TP in a column-parallel one); and the adapted layers' weights,
    which the weight sync sends merged from copies of their own."""
    table = table_for(hf, padded_vocab_size(hf["vocab_size"], 1, tp), transformer_engine)

    def counts(entry) -> tuple[int, int]:
        parts = adapted_parts(entry, modules) if entry else []
        if not parts:
            return 0, 0
        row = is_row_parallel(entry)
        adapters = sum(rank * entry.hf_shapes[p][1] for p in parts) // (tp if row else 1)
        adapters += rank * (entry.hf_shapes[0][0] if row else entry.local_shape(tp)[0])
        return adapters, math.prod(entry.local_shape(tp))

    split = PipelineSplit(hf["num_hidden_layers"], pp, vpp, stages)
    per_stage = []
    for stage in range(pp):
        entries = [table.layer_entries(layer).get(f"{name}.weight") for layer in split.stage_layers(stage)
                   for name in ADAPTABLE_LINEARS]
        if stage == pp - 1:  # lm_head, on the last stage
            entries.append(table.other["output_layer.weight"])
        stage_counts = [counts(entry) for entry in entries]
        per_stage.append((sum(a for a, _ in stage_counts), sum(m for _, m in stage_counts)))
    return max(per_stage, key=lambda stage: stage[0])
