"""Ray workers hosting Megatron TP=2 shards and vLLM engines: the engines get exactly the trainer's weights,
and generate what `transformers` generates with those weights, before and after an update."""
import pytest

from helpers.parity import family_model_dir
from helpers.weight_sync import check_sync_puts_trainer_weights_into_engines


# Colocated engines of TP=1 are the demo's, a separate engine the asynchronous runs': their every step checks them
# (tests/e2e/test_train_cli.py's mismatch, test_async.py's log-probs of the tokens sampled with the current weights).
@pytest.mark.parametrize("placement,engine_tp", [pytest.param("colocated", 1, marks=pytest.mark.slow),
                                                 ("colocated", 2),
                                                 pytest.param("separate", 1, marks=pytest.mark.slow)])
def test_sync_puts_trainer_weights_into_engines(ray_session, tiny_model_dir, placement, engine_tp):
    """The actor at TP=2 in two workers. Colocated, engine TP=1: one engine per worker; engine TP=2: one engine
    sharded over both workers. Separate: one engine in a third worker, sent the weights by broadcast."""
    check_sync_puts_trainer_weights_into_engines(tiny_model_dir, f"rollout.tensor_parallel_size={engine_tp}",
                                                 f"rollout.placement={placement}")


# Qwen3.5 stores the linear attention's input projection in four tensors, each part whole: its MoE model here (its
# dense one, the same projection over a dense MLP: tests/distributed/test_qwen3_next.py syncs it at engine TP=1 and
# TP=2).
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_sync_puts_hybrid_weights_into_engines(ray_session, tmp_path, model_type):
    """A hybrid model (Gated DeltaNet and gated full attention, MoE or dense): the engines' linear-attention layers
    carry their convolution and recurrent states from step to step in torch (rollout/cpu_gated_delta.py); their
    log-probs of the sampled tokens are the trainer's, their greedy answers transformers', before and after an
    update."""
    model_dir = family_model_dir(tmp_path / model_type, model_type, tied=False)
    # The trainer runs the Gated DeltaNet recurrence chunk by chunk, the engine token by token: more rounding apart
    # than attention alone. Measured 2026-11-30: 5.0e-6 dense, 1.0e-5 MoE (4.2e-6 both with the engine's linear
    # layers on oneDNN, which the tiny models no longer use: rollout/cpu_engine.py::ONEDNN_MIN_WEIGHTS).
    check_sync_puts_trainer_weights_into_engines(model_dir, log_prob_tolerance=2e-5)
