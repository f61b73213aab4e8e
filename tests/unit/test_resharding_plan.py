"""The transfer plan, as a pure function of what each rank holds and needs."""
import os
import threading

import pytest
import torch

from rl_megatron.models.weight_layouts import along, whole
from rl_megatron.resharding.channels import SharedBuffer, make_channel, shared_file_prefix
from rl_megatron.resharding import shared_params
from rl_megatron.resharding.shared_params import PeerReads, _remove_files_of_dead_processes
from rl_megatron.resharding.plan import PlanError, TensorSpec, build_plan

F32 = torch.float32


def rows(name, shape, start, stop, at=0):
    return along(name, shape, 0, start, stop, at)


def spec(key, shape, *regions):
    return TensorSpec(key, shape, F32, tuple(regions))


def test_local_rows_are_copied_in_place_and_the_rest_travels():
    sources = [[spec("s", (4, 2), rows("w", (8, 2), 0, 4))], [spec("s", (4, 2), rows("w", (8, 2), 4, 8))]]
    targets = [[spec("w", (8, 2), whole("w", (8, 2)))], []]
    plan = build_plan(sources, targets, bucket_bytes=1 << 20)
    (local,) = plan.local[0]
    assert (local.src.start, local.src.stop, local.dst.origin) == ((0, 0), (4, 2), (0, 0))
    (bucket,) = plan.buckets
    (piece,) = bucket.pieces
    assert (bucket.src_rank, bucket.dst_rank, piece.src.origin, piece.dst.origin) == (1, 0, (0, 0), (4, 0))
    assert plan.bytes_into(0) == 8 * 2 * 4


def test_a_replica_on_the_target_rank_is_preferred():
    norm = whole("norm", (6,))
    sources = [[spec("n", (6,), norm)], [spec("n", (6,), norm)]]
    plan = build_plan(sources, [[spec("t", (6,), norm)], [spec("t", (6,), norm)]], bucket_bytes=1 << 20)
    assert plan.buckets == [] and [p.src_rank for p in plan.local[1]] == [1]


def test_remote_reads_are_spread_over_replicas():
    a, b = whole("a", (4, 4)), whole("b", (4, 4))
    holder = [spec("a", (4, 4), a), spec("b", (4, 4), b)]
    plan = build_plan([[], holder, holder], [[spec("a", (4, 4), a), spec("b", (4, 4), b)], [], []], 1 << 20)
    assert sorted(bucket.src_rank for bucket in plan.buckets) == [1, 2]


def test_buckets_stay_within_their_size_and_large_pieces_are_cut():
    w = whole("w", (16, 4))  # 256 bytes
    plan = build_plan([[], [spec("w", (16, 4), w)]], [[spec("w", (16, 4), w)], []], bucket_bytes=64)
    assert all(b.nbytes <= 64 for b in plan.buckets)
    covered = sorted((p.dst.start[0], p.dst.stop[0]) for b in plan.buckets for p in b.pieces)
    assert covered[0][0] == 0 and covered[-1][1] == 16
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert sum(p.nbytes for b in plan.buckets for p in b.pieces) == 256


def test_phases_fill_their_own_targets_in_order():
    """A streamed export: targets split into phases, each phase's local copies and buckets only its own."""
    a, b, c = whole("a", (4, 2)), whole("b", (4, 2)), whole("c", (4, 2))
    sources = [[spec("a", (4, 2), a)], [spec("b", (4, 2), b), spec("c", (4, 2), c)]]
    targets = [[spec("a", (4, 2), a), spec("b", (4, 2), b), spec("c", (4, 2), c)], []]
    plan = build_plan(sources, targets, 1 << 20, phase_of={"b": 0, "a": 1, "c": 1}.__getitem__)
    first, second = plan.phases
    assert first.local == {} and [p.dst_key for bucket in first.rounds[0] for p in bucket.pieces] == ["b"]
    assert [p.dst_key for p in second.local[0]] == ["a"]
    assert [p.dst_key for round_ in second.rounds for bucket in round_ for p in bucket.pieces] == ["c"]
    assert plan.bytes_into(0) == 3 * 8 * 4 and len(plan.buckets) == 2  # the whole plan is their union


def test_fused_target_gathers_pieces_from_separate_tensors():
    # vLLM's qkv on one rank = [q; k; v] from three HF tensors held by three ranks.
    q, k, v = (whole(n, (2, 3)) for n in "qkv")
    target = spec("qkv", (6, 3), rows("q", (2, 3), 0, 2, 0), rows("k", (2, 3), 0, 2, 2), rows("v", (2, 3), 0, 2, 4))
    plan = build_plan([[spec("q", (2, 3), q)], [spec("k", (2, 3), k)], [spec("v", (2, 3), v)]], [[target], [], []],
                      1 << 20)
    placed = {p.src.hf_name: p.dst.origin[0] for p in plan.local[0] + [p for b in plan.buckets for p in b.pieces]}
    assert placed == {"q": 0, "k": 2, "v": 4}


def test_a_tensor_no_source_holds_is_named():
    with pytest.raises(PlanError, match="'model.norm.weight'.*no trainer shard holds"):
        build_plan([[]], [[spec("model.norm.weight", (4,), whole("model.norm.weight", (4,)))]], 1 << 20)


def test_a_shape_disagreement_names_both_shapes():
    with pytest.raises(PlanError, match=r"'w'.*\(8, 2\).*expects \(8, 3\)"):
        build_plan([[spec("w", (8, 2), whole("w", (8, 2)))]], [[spec("w", (8, 3), whole("w", (8, 3)))]], 1 << 20)


def test_rows_no_source_holds_are_named():
    sources = [[spec("s", (4, 2), rows("w", (8, 2), 0, 4))]]
    with pytest.raises(PlanError, match=r"'w'\[4:8, 0:2\]"):
        build_plan(sources, [[spec("w", (8, 2), whole("w", (8, 2)))]], 1 << 20)


def test_pieces_come_from_the_target_machine_when_a_holder_is_there():
    """7B's recipe on 2 nodes: 2 x 8 ranks, trainer TP=4 (DP=4: every shard exists on both nodes), engines of TP=1.
    Nothing needs to cross the network, and each node's reads are spread over that node's holders."""
    w = (16, 2)
    quarters = [spec("s", (4, 2), rows("w", w, 4 * q, 4 * q + 4)) for q in range(4)]
    sources = [[quarters[rank % 4]] for rank in range(16)]
    targets = [[spec("w", w, whole("w", w))] for _ in range(16)]
    hosts = ["node0"] * 8 + ["node1"] * 8
    plan = build_plan(sources, targets, 1 << 20, hosts=hosts)
    assert plan.buckets and all(hosts[b.src_rank] == hosts[b.dst_rank] for b in plan.buckets)
    assert sorted({b.src_rank for b in plan.buckets if hosts[b.dst_rank] == "node0"}) == list(range(8))
    crossing = [b for b in build_plan(sources, targets, 1 << 20).buckets if hosts[b.src_rank] != hosts[b.dst_rank]]
    assert crossing  # what ignoring the machines did: some pieces crossed the network


def test_the_shared_memory_channel_is_refused_on_gpus_with_the_fix():
    with pytest.raises(ValueError, match="resharding.channel=shared_memory.*CPU processes only.*auto or process_group"):
        make_channel("shared_memory", torch.device("cuda", 0), 1 << 20)  # refused before any CUDA call
    assert make_channel("shared_memory", torch.device("cpu"), 1 << 20).slots == 2
    with pytest.raises(ValueError, match="resharding.channel='carrier pigeon': choose one of auto, process_group"):
        make_channel("carrier pigeon", torch.device("cpu"), 1 << 20)


def test_the_sweep_removes_files_of_dead_processes_of_its_own_pid_namespace_only():
    """/dev/shm may be shared with other PID namespaces (containers, or the launch tests' nodes), where a process
    id means another process: their files are theirs."""
    own_dead = SharedBuffer.create(8)  # renamed below as a dead process's of this namespace
    dead = f"{shared_file_prefix()}{2 ** 22 + 1}-test"  # above the kernel's largest pid: never alive
    os.rename(own_dead.path, dead)
    other = f"/dev/shm/rl_megatron-1-{os.getpid()}-test"  # namespace inode 1: not this one
    open(other, "wb").close()
    try:
        _remove_files_of_dead_processes()
        assert not os.path.exists(dead) and os.path.exists(other)
    finally:
        os.unlink(other)


def test_a_rank_reads_a_peer_once_it_is_ready_and_returns_once_its_readers_are_done(monkeypatch):
    """`PeerReads`, two ranks in one process: rank 0 reads rank 1's parameters. Rank 1 waits at the end of a sync
    until rank 0 is done, and a peer that never comes is named after the wait's limit."""
    reader, source = PeerReads(sources={1}, readers=set()), PeerReads(sources=set(), readers={0})
    handles = [reader.own.handle, source.own.handle]
    for reads in (reader, source):
        reads.connect(handles)
    for reads in (reader, source):
        reads.own.unlink()
    for _ in range(2):  # two syncs
        source.ready()
        reader.ready()
        reader.wait_for_sources()
        waiting = threading.Thread(target=source.wait_for_readers)
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive()  # the reader has not said it is done
        reader.done()
        waiting.join(5)
        assert not waiting.is_alive()
    monkeypatch.setattr(shared_params, "WAIT_LIMIT_S", 0.0)
    reader.ready()  # a third sync the source never starts
    with pytest.raises(RuntimeError, match="waited 0 s for rank 1 to start this sync; that worker may be stuck"):
        reader.wait_for_sources()
    # A source whose process is gone is named as soon as the reader looks: its file's name holds its process id (of
    # this PID namespace only). (No file of a dead process here: any worker's sweep may remove it meanwhile.)
    never = 2 ** 22 + 1  # above the kernel's largest pid: never alive
    assert shared_params._creator(f"{shared_file_prefix()}{never}-test") == never
    assert shared_params._creator(f"/dev/shm/rl_megatron-1-{os.getpid()}-test") is None
    monkeypatch.setattr(shared_params, "WAIT_LIMIT_S", 3600.0)
    orphan, gone = PeerReads(sources={1}, readers=set()), SharedBuffer.create(16)
    orphan.connect([orphan.own.handle, gone.handle])
    orphan.own.unlink()
    gone.unlink()
    assert orphan.pids == {1: os.getpid()}
    orphan.pids[1] = never
    orphan.ready()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(process {never}\\) died before it could start this sync"):
        orphan.wait_for_sources()
