"""The distributed tier's ranks: one `LocalWorld` per size, shared by every test that asks for that many ranks (a
fresh world costs a process per rank and the joining of its group, and on a GPU machine the imports). Each run lays
Megatron's parallel state out anew and reseeds, so a test sees what fresh ranks would show it.

A world serves RUNS_PER_WORLD runs, then its ranks are replaced (forked again from the fork server that imported
everything: a fraction of a second). A model a run builds outlives the run: Megatron's DDP hooks its parameters'
gradient accumulators with closures over itself, a cycle through autograd's C++ graph that Python's collector
cannot free. With it live its process groups: a gloo group keeps a TCP thread waking to poll, three threads in all,
and ranks kept for the whole tier held 120-300 of them each: hundreds of runnable threads on 2 cores, which slowed
every other test beside them."""
import atexit

from rl_megatron.workers.spawn import LocalWorld

RUNS_PER_WORLD = 4

_worlds: dict[int, LocalWorld] = {}
_runs: dict[int, int] = {}  # runs each size's world has served


def run_distributed(fn, world_size: int, *layout, **options) -> list:
    """`rl_megatron.workers.spawn.run_distributed` on this size's shared world (started at its first use, again
    after a failure took it down, and after RUNS_PER_WORLD runs)."""
    world = _worlds.get(world_size)
    if world is None or not world.alive() or _runs[world_size] >= RUNS_PER_WORLD:
        if world is not None:
            world.close()
        world, _runs[world_size] = LocalWorld(world_size), 0
        _worlds[world_size] = world
    _runs[world_size] += 1
    return world.run(fn, *layout, **options)


def close_worlds() -> None:
    while _worlds:
        _worlds.popitem()[1].close()


atexit.register(close_worlds)
