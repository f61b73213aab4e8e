"""What each rank posts during a weight sync, replayed under NCCL's rules.

gloo's isend is truly asynchronous, so a CPU run completes schedules that hang on GPUs: NCCL runs the point-to-point
calls a rank posts outside one batched call in order, on one stream, and a call completes only when the peer's
matching call runs at the same time. The real `Resharder.sync` runs here on gloo with torch.distributed's
point-to-point functions recorded, in layouts like the shipped configs' (each trainer shard exchanged both ways
in one round: TP=2 into engines of TP=1 as in the demo, routed experts split by EP into engines of TP=2, TP=4 into
engines of TP=2 as in the 7B recipe); the recorded posts must complete under NCCL's rules."""
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from rl_megatron.models.weight_layouts import along, whole
from rl_megatron.resharding import Resharder
from rl_megatron.resharding.plan import TensorSpec
from helpers.worlds import run_distributed

WORLD = 4


def rows(name, shape, start, stop, at=0):
    return along(name, shape, 0, start, stop, at)


def values(name: str, shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * len(name)


def layouts(rank: int) -> dict[str, tuple[list, list]]:
    """layout -> (this rank's sources, its targets), as (hf name, region) lists."""
    dense, expert = (8, 4), (4, 4)
    tp2_to_tp1 = ([("w", rows("w", dense, 4 * rank, 4 * rank + 4))], [("w", whole("w", dense))]) if rank < 2 \
        else ([], [])
    # 8 experts, 2 per rank (EP=4); engines of TP=2 on ranks (0, 1) and (2, 3), each keeping half of every expert.
    experts = [f"e{i}" for i in range(8)]
    ep_to_tp2 = ([(e, whole(e, expert)) for e in experts[2 * rank:2 * rank + 2]],
                 [(e, rows(e, expert, 2 * (rank % 2), 2 * (rank % 2) + 2)) for e in experts])
    # TP=4 (a quarter each) into engines of TP=2 (a half each).
    tp4_to_tp2 = ([("w", rows("w", dense, 2 * rank, 2 * rank + 2))],
                  [("w", rows("w", dense, 4 * (rank % 2), 4 * (rank % 2) + 4))])
    return {"tp2_to_tp1": tp2_to_tp1, "ep4_to_tp2": ep_to_tp2, "tp4_to_tp2": tp4_to_tp2}


def _held(named_regions, fill: bool) -> dict:
    held = {}
    for name, region in named_regions:
        shape = tuple(b - a for a, b in zip(region.start, region.stop))
        tensor = values(name, region.hf_shape)[tuple(slice(a, b) for a, b in zip(region.start, region.stop))].clone() \
            if fill else torch.zeros(shape)
        key = f"{name}[{region.start}]"
        local = along(name, region.hf_shape, 0, region.start[0], region.stop[0], 0)
        held[key] = (tensor, TensorSpec(key, shape, torch.float32, (local,)))
    return held


def _recorded_syncs():
    """Every layout synced over the process-group channel; per layout, this rank's posts (each a tuple of
    ("send" | "recv", peer) posted together) and whether its targets came out right."""
    posts, inside = [], []  # `inside`: a recorded call is running (it may re-enter through torch's dispatch)

    def recording(kind, call):
        def record(tensor, *args, **kwargs):
            if not inside:  # a call of its own, not one of a batch: a post by itself
                peer = args[0] if args else next(kwargs[k] for k in ("dst", "src", "group_dst", "group_src")
                                                 if kwargs.get(k) is not None)
                posts.append(((kind, peer),))
            inside.append(True)
            try:
                return call(tensor, *args, **kwargs)
            finally:
                inside.pop()
        record.kind = kind
        return record

    def batch(ops):
        posts.append(tuple((op.op.kind, op.peer) for op in ops))
        inside.append(True)
        try:
            return original_batch(ops)
        finally:
            inside.pop()

    original_batch = dist.batch_isend_irecv
    wrapped = {"isend": recording("send", dist.isend), "irecv": recording("recv", dist.irecv),
               "send": recording("send", dist.send), "recv": recording("recv", dist.recv)}
    for module in (dist, c10d):  # P2POp checks its op against the c10d module's own names
        for name, function in wrapped.items():
            setattr(module, name, function)
        module.batch_isend_irecv = batch
    out = {}
    for layout, (sources, targets) in layouts(dist.get_rank()).items():
        posts.clear()
        resharder = Resharder(_held(sources, True), [], _held(targets, False), bucket_bytes=1 << 20,
                              channel="process_group")
        resharder.sync()
        resharder.close()
        exact = all(torch.equal(tensor, values(spec.regions[0].hf_name, spec.regions[0].hf_shape)[
            tuple(slice(a, b) for a, b in zip(spec.regions[0].start, spec.regions[0].stop))])
            for tensor, spec in resharder.targets.values())
        out[layout] = (list(posts), exact)
    return out


def completes_under_nccl(posts: list[list[tuple]]) -> bool:
    """Whether every rank's posts complete when each rank runs its posts in order and a post completes only when
    every call in it meets its peer's matching call in a post running at the same time."""
    heads = [0] * len(posts)
    while any(h < len(p) for h, p in zip(heads, posts)):
        running = {rank for rank, p in enumerate(posts) if heads[rank] < len(p)}
        changed = True
        while changed:  # the largest set of running posts whose calls all meet their peers' within the set
            changed = False
            for rank in sorted(running):
                for kind, peer in posts[rank][heads[rank]]:
                    other = "recv" if kind == "send" else "send"
                    if peer not in running or (other, rank) not in posts[peer][heads[peer]]:
                        running.discard(rank)
                        changed = True
                        break
        if not running:
            return False
        for rank in running:
            heads[rank] += 1
    return True


def test_completes_under_nccl_sees_the_classic_deadlock():
    # Both ranks post a send alone, then the receive: each send waits for a receive queued behind the peer's send.
    assert not completes_under_nccl([[(("send", 1),), (("recv", 1),)], [(("send", 0),), (("recv", 0),)]])
    assert completes_under_nccl([[(("send", 1), ("recv", 1))], [(("send", 0), ("recv", 0))]])
    assert completes_under_nccl([[(("send", 1),)], [(("recv", 0),)]])


def test_every_sync_schedule_completes_under_nccl():
    per_rank = run_distributed(_recorded_syncs, world_size=WORLD)
    for layout in per_rank[0]:
        assert all(result[layout][1] for result in per_rank), f"{layout}: targets differ from the sources"
        posts = [result[layout][0] for result in per_rank]
        assert any(posts), layout  # the layout exchanges something
        assert completes_under_nccl(posts), f"{layout}: the ranks' posts deadlock under NCCL: {posts}"
