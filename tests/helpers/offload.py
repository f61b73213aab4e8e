"""Shared by the offload tests (tests/distributed on gloo at TP=2, tests/gpu on CUDA): the doctor's round trip
(rl_megatron/doctor/offload_check.py) on every rank."""
from helpers.parity import config
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.doctor.offload_check import LAYOUTS, round_trip, round_trip_batches
from helpers.worlds import run_distributed


def round_trips(model_dir: str, tp: int, layouts=LAYOUTS) -> list[dict]:
    """Per rank, per layout: what `round_trip` measured (at TP=`tp`, DP=1)."""
    batches = round_trip_batches(read_hf_config(model_dir)["vocab_size"])
    return run_distributed(round_trip, world_size=tp, tp=tp, args=(config(model_dir, tp=tp, pp=1), batches, layouts))
