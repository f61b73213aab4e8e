"""A training step that never waits on the host more often as the model or the packing grows: the host syncs of an
update (given the old log-probs, or giving them: trainer/old_log_probs.py) and of a log-prob pass, counted by the
bench's counter (the operations a GPU run would wait on, counted on CPU: rl_megatron/bench/host_syncs.py), stay
within 4 + 2 per micro-batch and do not change with the number of layers or of sample spans per packed row. And a
log-prob pass holds little more than the float32 logits of its response tokens at its peak: no logits at prompt
positions, no full-vocabulary float32 copies."""
import dataclasses

import torch

from helpers.parity import config, family_model_dir
from helpers.ranks import build_actor
from rl_megatron.batch import TrainBatch
from helpers.worlds import run_distributed

SAMPLES, SEQ = 16, 24
# (layers, samples per micro-batch): 16 micro-batches of one span each, and one micro-batch of 16 spans
SHAPES = [(2, 1), (8, 1), (2, 16), (8, 16)]
WIDE_VOCAB = 32768


def varied_batch(vocab: int) -> TrainBatch:
    """Samples of different lengths (the real runs' `lengths` field set), half of each response."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (SAMPLES,), generator=g)
    input_ids = torch.randint(3, vocab, (SAMPLES, SEQ), generator=g)
    mask = torch.zeros(SAMPLES, SEQ)
    for row, length in enumerate(lengths.tolist()):
        input_ids[row, length:] = 0
        mask[row, length // 2 - 1:length - 1] = 1.0
    return TrainBatch(input_ids, mask, pad_id=0, lengths=lengths, advantages=torch.randn(SAMPLES, generator=g),
                      old_log_probs=-torch.rand(SAMPLES, SEQ, generator=g))


def counted(cfgs, batch, wide_cfg, wide_batch):
    from rl_megatron.bench.host_syncs import count_syncs
    from rl_megatron.bench.measure import peak_extra_memory

    wide = build_actor(wide_cfg)
    peak = peak_extra_memory(lambda: wide.log_probs(wide_batch))
    response = max(int(m.samples.response_mask.sum()) for m in wide.micro_batches(wide_batch))
    results = [(peak, response)]
    for cfg in cfgs:
        actor = build_actor(cfg)
        actor.update(batch)  # the optimizer's state exists from here on
        micros = len(actor.micro_batches(batch))
        update = count_syncs(actor, lambda: actor.update(batch))
        log_probs = count_syncs(actor, lambda: actor.log_probs(batch))
        on_policy = count_syncs(actor, lambda: actor.policy_update(dataclasses.replace(batch, old_log_probs=None)))
        results.append((micros, update.count, update.report(), log_probs.count, log_probs.report(),
                        on_policy.count, on_policy.report()))
    return results


def test_host_syncs_do_not_grow_with_layers_or_spans(tmp_path):
    dirs = {layers: family_model_dir(tmp_path / str(layers), "qwen2", tied=False, layers=layers)
            for layers in {layers for layers, _ in SHAPES}}
    cfgs = [config(dirs[layers], 1, 1, **{"trainer.n_gpus_per_node": 1, "actor.micro_batch_size": micro,
                                          "actor.ppo_mini_batch_size": SAMPLES // 2, "rollout.n": 2,
                                          "data.train_batch_size": SAMPLES // 2, "actor.sequence_packing": True})
            for layers, micro in SHAPES]
    batch = varied_batch(vocab=18)
    # A vocabulary large against the width, as real models have, so that the logits are the pass's largest tensor.
    wide_dir = family_model_dir(tmp_path / "wide", "qwen2", tied=False, layers=1, vocab_size=WIDE_VOCAB)
    wide_cfg = config(wide_dir, 1, 1, **{"trainer.n_gpus_per_node": 1, "actor.micro_batch_size": SAMPLES,
                                         "actor.ppo_mini_batch_size": SAMPLES // 2, "rollout.n": 2,
                                         "data.train_batch_size": SAMPLES // 2,
                                         "model.make_vocab_size_divisible_by": 1})
    (peak, response), *results = run_distributed(counted, 1, args=(cfgs, batch, wide_cfg,
                                                                   varied_batch(WIDE_VOCAB)))[0]
    assert peak <= 1.25 * response * WIDE_VOCAB * 4, (peak, response)
    for (layers, micro), (micros, update, update_sites, log_probs, log_prob_sites, on_policy, on_policy_sites) in zip(
            SHAPES, results):
        assert micros == SAMPLES // micro
        assert update <= 4 + 2 * micros, (layers, micro, update_sites)
        assert log_probs <= 4 + 2 * micros, (layers, micro, log_prob_sites)
        # The update that gives the old log-probs: its outputs copied to the host once more, as a log-prob pass's.
        assert on_policy <= update + 1, (layers, micro, on_policy_sites)
    by_shape = dict(zip(SHAPES, results))
    for micro in (1, 16):  # the same at 2 and 8 layers
        assert by_shape[(2, micro)][1] == by_shape[(8, micro)][1], (by_shape[(2, micro)][2], by_shape[(8, micro)][2])
        assert by_shape[(2, micro)][3] == by_shape[(8, micro)][3]
        assert by_shape[(2, micro)][5] == by_shape[(8, micro)][5]
    # one span per micro-batch or sixteen: the same
    assert by_shape[(2, 1)][1] == by_shape[(2, 16)][1] and by_shape[(2, 1)][3] == by_shape[(2, 16)][3]
    assert by_shape[(2, 1)][5] == by_shape[(2, 16)][5]
