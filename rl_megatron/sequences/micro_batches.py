"""A micro-batch: some of a rank's samples, as the rows the model computes, and the way back to per-sample tensors.

Two layouts of the same samples:

- packed (`sequence_packing`): one row, the samples back to back; `cu_seqlens` marks where each starts, so that
  attention stays within a sample (Transformer Engine's THD layout on GPU, `models/packed_attention.py` on CPU) and
  rotary positions restart per sample. No padding but the row's tail up to `multiple`. A sample whose
  `TrainBatch.position_ids` restart (an agent episode its harness forked) is several spans, one per restart.
- padded: one row per sample, right-padded to the micro-batch's longest sample (not the whole batch's).

Either way the model's per-token outputs come back through `unpack` as [samples, longest] tensors laid out as the
`TrainBatch` is (position t holds what is predicted at t: the label t + 1), zero beyond each sample's tokens. So the
losses see the same tensors whatever the layout, and their normalisation does not depend on the grouping.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rl_megatron.batch import TokenOutputs, TrainBatch, to_device


@dataclass
class MicroBatch:
    samples: TrainBatch  # the micro-batch's samples, right-padded to the longest of them
    rows: list[int]  # their rows in the rank's batch
    lengths: list[int]  # each sample's tokens, known on the host (never read back from the device)
    input_ids: Tensor  # [rows, tokens]: what the model reads (packed: one row)
    position_ids: Tensor  # [rows, tokens]
    cu_seqlens: list[int] | None  # packed: the start of each attention span in the row (a sample's, or each of a
    # forked sample's), then the row's end (the tail of padding, if any, is a span of its own); None: padded rows
    context_index: Tensor | None = None  # context parallelism: the row's positions this rank computes
    read_positions: Tensor | None = None  # [2, n]: the only positions whose outputs a pass reads (`reading_responses`),
    # flattened as [rows, tokens] (row 0) and as Megatron's sequence-first [tokens, rows] (row 1); None: all
    sample_starts: list[int] | None = None  # packed: where each sample starts in the row, then where the last ends

    def model_inputs(self) -> tuple[Tensor, Tensor]:
        """(token ids, position ids) this rank's model reads: the row, or its context-parallel share."""
        if self.context_index is None:
            return self.input_ids, self.position_ids
        return self.input_ids[:, self.context_index], self.position_ids[:, self.context_index]

    @property
    def labels(self) -> Tensor:
        """The token each model position predicts (the next one in its row; pad after the row's last)."""
        ids = self.input_ids
        labels = torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), self.samples.pad_id)], dim=1)
        return labels if self.context_index is None else labels[:, self.context_index]

    def computed_tokens(self) -> int:
        return self.input_ids.numel()

    def to_device(self, device: torch.device) -> MicroBatch:
        """This micro-batch on the compute device, the host not waiting for the copies."""
        return MicroBatch(self.samples.to_device(device), self.rows, self.lengths, to_device(self.input_ids, device),
                          to_device(self.position_ids, device), self.cu_seqlens,
                          *(None if t is None else to_device(t, device) for t in (self.context_index,
                                                                                  self.read_positions)),
                          self.sample_starts)

    def reading_responses(self) -> MicroBatch:
        """This micro-batch, its outputs read at the response tokens' positions only (position t predicts token
        t + 1: those where `response_mask` is set), so that the output layer and the log-probs compute nothing
        else. Computed on the host, in this micro-batch's final layout."""
        sample, offset = self.samples.response_mask.bool().nonzero(as_tuple=True)
        if self.cu_seqlens is None:
            row, column = sample, offset
        else:
            row, column = torch.zeros_like(sample), torch.tensor(self.sample_starts)[sample] + offset
        rows, tokens = self.input_ids.shape
        return dataclasses.replace(self, read_positions=torch.stack([row * tokens + column, column * rows + row]))

    def context_shard(self, rank: int, size: int) -> MicroBatch:
        """This micro-batch as context-parallel rank `rank` of `size` computes it (`context_chunks`)."""
        return dataclasses.replace(self, context_index=context_chunks(self.cu_seqlens, rank, size))

    def padded_to(self, rows: int, tokens: int) -> MicroBatch:
        """The same samples in a model input of `rows` x `tokens` (pipeline stages and expert-parallel peers that
        cannot exchange shapes all run one shape): extra rows are all padding, extra tokens are padding that
        attends to itself (packed: a span of its own)."""
        ids = F.pad(self.input_ids, (0, tokens - self.input_ids.shape[1], 0, rows - self.input_ids.shape[0]),
                    value=self.samples.pad_id)
        positions = torch.arange(tokens).expand_as(ids)
        cu_seqlens = self.cu_seqlens
        if cu_seqlens is not None:
            real = self.sample_starts[-1]  # where the samples' spans end
            cu_seqlens = [start for start in self.cu_seqlens if start <= real] + ([tokens] if tokens > real else [])
            positions = torch.cat([self.position_ids[0, :real], torch.arange(tokens - real)]).unsqueeze(0)
        return MicroBatch(self.samples, self.rows, self.lengths, ids, positions, cu_seqlens,
                          sample_starts=self.sample_starts)

    def unpack(self, per_token: Tensor) -> Tensor:
        """Model-layout [rows, tokens, ...] -> [samples, longest, ...], zero beyond each sample's tokens."""
        lengths, device = self.lengths, per_token.device
        longest = self.samples.input_ids.shape[1]
        if self.cu_seqlens is None:
            out = per_token[:len(lengths), :longest]
        else:
            index = torch.cat([torch.arange(start, start + longest) for start in self.sample_starts[:len(lengths)]])
            out = per_token[0].index_select(0, to_device(index.clamp(max=per_token.shape[1] - 1), device))
            out = out.view(len(lengths), longest, *per_token.shape[2:])
        inside = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # built on the host
        inside = inside.view(*inside.shape, *[1] * (out.dim() - 2))
        return torch.where(to_device(inside, device), out, torch.zeros((), dtype=out.dtype, device=device))

    def model_layout(self, per_sample: Tensor, fill: int = 0) -> Tensor:
        """`unpack`'s inverse: a per-sample tensor [samples, longest, ...] laid out as the positions this rank's model
        computes ([rows, tokens, ...], or the context-parallel share), `fill` where no sample's token is."""
        rows, tokens = self.input_ids.shape
        out = per_sample.new_full((rows, tokens, *per_sample.shape[2:]), fill)
        for sample, length in enumerate(self.lengths):
            row, start = (sample, 0) if self.cu_seqlens is None else (0, self.sample_starts[sample])
            out[row, start:start + length] = per_sample[sample, :length]
        return out if self.context_index is None else out[:, self.context_index]

    def unpack_outputs(self, outputs: TokenOutputs) -> TokenOutputs:
        return TokenOutputs(**{name: self.unpack(value) for name, value in outputs.tensors().items()})


def micro_batch(batch: TrainBatch, rows: list[int], packing: bool, multiple: int = 1,
                span_multiple: int = 1) -> MicroBatch:
    """Rows `rows` of `batch` as one micro-batch; `multiple`: the model's tokens per row must be a multiple of it
    (sequence parallelism splits them over the TP ranks); `span_multiple`: packed, each sample's span is padded to
    a multiple of it (context parallelism cuts every span into 2 x CP chunks)."""
    picked = batch._with({k: v[rows] for k, v in batch.tensors().items()})
    lengths = picked.sequence_lengths()
    samples = picked.truncated(max(lengths))
    if not packing:
        if samples.position_ids is not None:
            raise ValueError("a forked agent episode (positions restarting within its sample) trains as spans of a "
                             "packed row: set actor.sequence_packing=true")
        input_ids = _pad_tokens(samples.input_ids, multiple, batch.pad_id)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return MicroBatch(samples, rows, lengths, input_ids, positions, None)
    spans = [length + -length % span_multiple for length in lengths]
    pieces = [_attention_spans(samples.position_ids, row, length, span)
              for row, (length, span) in enumerate(zip(lengths, spans))]
    sample_starts = [0, *itertools.accumulate(spans)]
    ids = _packed_row(samples.input_ids, lengths, spans, sample_starts, batch.pad_id)
    input_ids = _pad_tokens(ids, multiple, batch.pad_id)
    spans_in_row = [piece for sample in pieces for piece in sample]
    tail = input_ids.shape[1] - ids.shape[1]
    if tail:  # the padding is a sample of its own: it attends to itself only
        spans_in_row.append(tail)
    starts = [0, *itertools.accumulate(spans_in_row)]
    positions = _restarting_positions(spans_in_row, starts)
    return MicroBatch(samples, rows, lengths, input_ids, positions.unsqueeze(0), starts,
                      sample_starts=sample_starts)


def _packed_row(input_ids: Tensor, lengths: list[int], spans: list[int], starts: list[int], pad_id: int) -> Tensor:
    """Each row's first `length` tokens, padded with `pad_id` to its `span`, one after the other in one row (`starts`:
    where each span begins, and the end). One gather, by an index built on the host and copied up without waiting:
    not a pad per sample (each a torch call through the host's dispatch), nor a mask whose size the host reads back."""
    width = input_ids.shape[1]
    token = torch.arange(starts[-1])
    # per token: how far its sample's span starts from that sample's row in the flat input, and where its length ends
    shift, end = torch.repeat_interleave(torch.tensor([[start - row * width for row, start in enumerate(starts[:-1])],
                                                       [start + length for start, length in zip(starts, lengths)]]),
                                         torch.tensor(spans), dim=1)
    source = torch.where(token < end, token - shift, input_ids.numel())  # padding: the pad id appended below
    flat = torch.cat([input_ids.reshape(-1), input_ids.new_full((1,), pad_id)])
    return flat[to_device(source, input_ids.device)].unsqueeze(0)


def _restarting_positions(pieces: list[int], starts: list[int]) -> Tensor:
    """0, 1, ... within each of consecutive pieces of these lengths (`starts`: where each begins, and the end):
    `torch.cat([torch.arange(n) for n in pieces])` without a tensor per piece."""
    return torch.arange(starts[-1]) - torch.repeat_interleave(torch.tensor(starts[:-1]), torch.tensor(pieces))


def _attention_spans(position_ids: Tensor | None, row: int, length: int, span: int) -> list[int]:
    """The lengths of a sample's attention spans in a packed row (its share: `span` tokens, its `length` and the
    padding up to span_multiple): one, or one per restart of its positions (a forked agent episode)."""
    if position_ids is None:
        return [span]
    restarts = (position_ids[row, :length] == 0).nonzero().flatten().tolist()
    if len(restarts) > 1 and span != length:
        raise ValueError("a forked agent episode (positions restarting within its sample) cannot be cut for context "
                         "parallelism: set actor.context_parallel_size=1")
    return [end - start for start, end in zip(restarts, restarts[1:] + [length])][:-1] + [span - restarts[-1]]


def context_chunks(cu_seqlens: list[int], rank: int, size: int) -> Tensor:
    """The positions of a packed row that context-parallel rank `rank` of `size` computes: every span cut into
    2 x size equal chunks, of which the rank takes chunk `rank` and chunk 2 x size - 1 - rank, so that under the
    causal mask each rank has as much work (Megatron's and Transformer Engine's THD split, as NeMo-RL packs)."""
    index = []
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        chunk = (end - start) // (2 * size)
        if chunk * 2 * size != end - start:
            raise ValueError(f"a span of {end - start} tokens does not cut into 2 x {size} chunks")
        for part in (rank, 2 * size - 1 - rank):
            index.append(torch.arange(start + part * chunk, start + (part + 1) * chunk))
    return torch.cat(index)


def _pad_tokens(ids: Tensor, multiple: int, pad_id: int) -> Tensor:
    return F.pad(ids, (0, -ids.shape[1] % multiple), value=pad_id)


def outputs_to_host(outputs: list[TokenOutputs]) -> list[TokenOutputs]:
    """Per-micro-batch outputs ([samples, longest, ...] each) copied to the host: the [samples, longest] ones (floats)
    in one transfer, each with more dimensions (the routing R2 records, a teacher's top-k) in one of its own. The host
    waits for the device once per output kind, not once per micro-batch."""
    names = list(outputs[0].tensors())
    longest = {name: max(o.tensors()[name].shape[1] for o in outputs) for name in names}

    def joined(name: str) -> Tensor:  # every micro-batch's samples, padded to the longest
        return torch.cat([F.pad(value, (0, 0) * (value.dim() - 2) + (0, longest[name] - value.shape[1]))
                          for value in (o.tensors()[name] for o in outputs)])

    flat = [name for name in names if outputs[0].tensors()[name].dim() == 2]
    host = dict(zip(flat, torch.stack([joined(name) for name in flat]).to("cpu"))) if flat else {}
    host |= {name: joined(name).to("cpu") for name in names if name not in flat}
    parts, start = [], 0
    for o in outputs:
        values = o.tensors()
        count = values[names[0]].shape[0]
        parts.append(TokenOutputs(**{name: host[name][start:start + count, :values[name].shape[1]]
                                     for name in names}))
        start += count
    return parts


def scatter_rows(parts: list[tuple[list[int], TokenOutputs]], count: int, length: int) -> TokenOutputs:
    """Per-sample outputs of micro-batches ((rows, outputs [samples, longest]) each) in the rank's row order, as
    [count, length] tensors (zero beyond each sample)."""
    first = parts[0][1].tensors()
    out = {name: value.new_zeros(count, length, *value.shape[2:]) for name, value in first.items()}
    for rows, outputs in parts:
        for name, value in outputs.tensors().items():
            out[name][rows, :value.shape[1]] = value
    return TokenOutputs(**out)
