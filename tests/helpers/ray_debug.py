"""What a run's workers saw of Ray's debugger: RAY_DEBUG as each worker reported it with its placement (a
`WorkerGroup` logs its placement at INFO, the list as the record's `placement` attribute). For a run in this
process (`trainer.train(cfg)`) with RAY_DEBUG set and caplog at INFO for rl_megatron.workers.worker_group:

    assert_ray_debug_reached_workers(caplog.records, "legacy")
"""


def assert_ray_debug_reached_workers(records, mode: str) -> None:
    """Every worker of every group placed in `records` saw RAY_DEBUG=`mode`."""
    placements = [record.placement for record in records if hasattr(record, "placement")]
    assert placements, "no worker group logged its placement: set caplog to INFO for rl_megatron.workers.worker_group"
    missed = [(where.rank, where.node_ip, where.ray_debug) for placement in placements for where in placement
              if where.ray_debug != mode]
    assert not missed, f"RAY_DEBUG={mode} did not reach these workers (rank, node, their RAY_DEBUG): {missed}"
