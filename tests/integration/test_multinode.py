"""Two Ray nodes simulated on this machine (`ray.cluster_utils.Cluster`, 2 CPU slots each): the trainer places its
workers node by node, so that no tensor-parallel group crosses a node, and GRPO steps run across the nodes."""
import json
import logging
import os
import time

import pytest

from helpers.ray_debug import assert_ray_debug_reached_workers

NODES, SLOTS_PER_NODE = 2, 2
pytestmark = pytest.mark.own_ray  # after the test run's Ray has ended (tests/conftest.py)


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "a local Ray of this process would stand in for the cluster"
    # Workers get no GLOO_SOCKET_IFNAME from the trainer off a local Ray (as on a real cluster): take this
    # session's out of the environment the nodes inherit.
    with pytest.MonkeyPatch.context() as env:
        env.delenv("GLOO_SOCKET_IFNAME", raising=False)
        cluster = Cluster()
        for _ in range(NODES):
            cluster.add_node(num_cpus=SLOTS_PER_NODE, object_store_memory=128 * 1024**2)
        cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_pool_larger_than_cluster_fails_naming_what_is_missing(two_node_cluster, caplog):
    import ray

    from rl_megatron.workers.cluster import ClusterError
    from rl_megatron.workers.worker_group import ResourcePool

    with pytest.raises(ClusterError, match=r"trainer.nnodes=3 x trainer.n_gpus_per_node=2 asks for 3 node\(s\) with "
                                           r"2 free CPU each.*Ray has 2 alive node\(s\)"):
        ResourcePool(3, SLOTS_PER_NODE, ready_timeout_s=2)
    # Said at once (an autoscaler may still add nodes), before the wait.
    assert any("waiting up to 2 s" in record.getMessage() for record in caplog.records)
    # The pending groups were removed: the cluster's slots are free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < NODES * SLOTS_PER_NODE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == NODES * SLOTS_PER_NODE


def test_grpo_across_two_nodes_keeps_tensor_parallel_groups_within_a_node(two_node_cluster, tmp_path, caplog,
                                                                          monkeypatch):
    """Also: RAY_DEBUG, set for the controller only (the nodes were started without it), reaches every node's
    workers."""
    import ray
    from megatron.core.parallel_state import RankGenerator

    from rl_megatron.preflight import load_config
    from rl_megatron.trainer.trainer import train

    tp = 2
    cfg = load_config("configs/demo_cpu.yaml", [
        f"ray.address={two_node_cluster.address}", f"trainer.nnodes={NODES}",
        f"trainer.n_gpus_per_node={SLOTS_PER_NODE}",
        f"actor.tensor_model_parallel_size={tp}", "trainer.total_steps=3", "trainer.target_reward=null",
        "trainer.progress_bar=false", f"trainer.log_dir={tmp_path}",
        # 4 engines of 2 prompts x 4 samples; 2 data-parallel ranks of 8 samples per mini-batch
        "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=8"])
    caplog.set_level(logging.INFO, logger="rl_megatron.workers.worker_group")
    monkeypatch.setenv("RAY_DEBUG", "legacy")  # Ray's own pdb: nothing to install, and no breakpoint is hit here
    summary = train(cfg)
    assert_ray_debug_reached_workers(caplog.records, "legacy")

    [placement] = [record.placement for record in caplog.records if hasattr(record, "placement")]
    node_of = {where.rank: where.node_id for where in placement}
    assert sorted(node_of) == list(range(NODES * SLOTS_PER_NODE))
    # Megatron's own rank order (the one initialize_model_parallel uses) gives the TP groups.
    world = NODES * SLOTS_PER_NODE
    tp_groups = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("tp")
    assert all(len({node_of[rank] for rank in group}) == 1 for group in tp_groups)
    # Rank r runs on pool node r // SLOTS_PER_NODE, and the two pool nodes are the cluster's two nodes.
    pool_nodes = [node_of[index * SLOTS_PER_NODE] for index in range(NODES)]
    assert all(node_of[rank] == pool_nodes[rank // SLOTS_PER_NODE] for rank in node_of)
    assert set(pool_nodes) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}

    assert summary.steps == 3
    with open(os.path.join(summary.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["actor/grad_norm"] > 0 for row in rows)
    # The engines on both nodes sample from exactly the weights the trainer holds.
    assert max(row["mismatch/max_abs_logprob_diff"] for row in rows) < 1e-5
