"""Scripted engines' calls run as a Ray actor runs its methods: one at a time per engine, in the order they were made.
The turn scheduler relies on it (rl_megatron/rollout/serving.py makes an engine's next `serve` call before the current
one's result is back), so a fake whose `serve` awaits mid-call must not let two calls of one engine interleave."""
import asyncio
import collections
import functools


def one_at_a_time(method):
    """Decorate an async engine method whose first argument after self is the engine's index. `self.open_calls[e]`:
    the names of engine e's calls made and not yet returned, oldest first (the one running among them)."""
    @functools.wraps(method)
    async def serialised(self, engine: int, *args, **kwargs):
        locks = self.__dict__.setdefault("_actor_locks", collections.defaultdict(asyncio.Lock))
        calls = self.__dict__.setdefault("open_calls", collections.defaultdict(list))
        calls[engine].append(method.__name__)
        try:
            # asyncio's locks are first come, first served (and bound to one event loop: a fake may serve several)
            async with locks[asyncio.get_running_loop(), engine]:
                return await method(self, engine, *args, **kwargs)
        finally:
            calls[engine].remove(method.__name__)
    return serialised
