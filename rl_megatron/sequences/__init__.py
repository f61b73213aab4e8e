"""How a rank's samples become the rows Megatron computes: micro-batches by sample count or token budget
(`bins.py`), packed or right-padded (`micro_batches.py`), and the order that balances tokens over data-parallel
ranks. Pure tensor code: no Megatron, no distributed calls."""
from rl_megatron.sequences.bins import balanced_order, fixed_bins, round_up, split_to_count, token_budget_bins
from rl_megatron.sequences.micro_batches import (MicroBatch, context_chunks, micro_batch, outputs_to_host,
                                                scatter_rows)

__all__ = ["MicroBatch", "balanced_order", "context_chunks", "fixed_bins", "micro_batch", "outputs_to_host", "round_up",
           "scatter_rows", "split_to_count", "token_budget_bins"]
