"""The distributed tier's ranks: one `LocalWorld` per size, shared by every test that asks for that many ranks (a
fresh world costs a process per rank and the joining of its group, and on a GPU machine the imports). Each run lays
Megatron's parallel state out anew and reseeds, so a test sees what fresh ranks would show it."""
import atexit

from rl_megatron.workers.spawn import LocalWorld

_worlds: dict[int, LocalWorld] = {}


def run_distributed(fn, world_size: int, *layout, **options) -> list:
    """`rl_megatron.workers.spawn.run_distributed` on this size's shared world (started at its first use, and again
    after a failure took it down)."""
    world = _worlds.get(world_size)
    if world is None or not world.alive():
        world = _worlds[world_size] = LocalWorld(world_size)
    return world.run(fn, *layout, **options)


def close_worlds() -> None:
    while _worlds:
        _worlds.popitem()[1].close()


atexit.register(close_worlds)
