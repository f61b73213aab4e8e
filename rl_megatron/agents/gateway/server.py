"""The gateway's HTTP side: an aiohttp web server on one listening socket kept for the run, served from the event loop
of the rollout that runs the episodes.

    POST /episodes/<id>/v1/chat/completions    POST /episodes/<id>/v1/completions    GET /episodes/<id>/v1/models

Served in the rollout's own event loop (while any of its episodes runs), a call reaches its episode and the
engines' scheduler without a thread between them: no hand-over between event loops and no contention for the GIL
between two threads, which cost a few milliseconds a call on a loaded CPU. The agents themselves run in worker
processes (rollout.agent.num_workers, `loop.py`); in this loop with 0, a plain (not async) function in a thread of its
own, so that blocking I/O in it cannot stall it.

An episode's base URL carries its id (16 random bytes): the only way to reach an episode, so a request without one,
or with an unknown or ended one, is refused (404). A client that hangs up mid-call does not cancel the call (the
episode records what was sampled; a retry of the same messages then forks, never repeats the context). Every error
is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` with a 4xx status, and none reaches the run.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

from aiohttp import web

from rl_megatron.agents.gateway.episode import Episode, EpisodeEnded
from rl_megatron.agents.gateway.openai_api import (ApiError, RunSampling, chat_chunks, models_list,
                                                   parse_chat_request, parse_completion_request, server_sent_events,
                                                   text_chunks)

logger = logging.getLogger(__name__)
BACKLOG = 1024  # connections the kernel queues: every episode of a batch may connect at once


class GatewayServer:
    """Episodes by id, served over HTTP. `start` binds the socket (once, for the run); `serving()` serves it from the
    running event loop while any episode there is inside it; `open` makes an episode reachable (its base URL)."""

    def __init__(self, host: str, port: int, model: str, sampling: RunSampling):
        self.host, self.port, self.model, self.sampling = host, port, model, sampling
        self._episodes: dict[str, Episode] = {}
        self._socket: socket.socket | None = None
        self._loops: dict[asyncio.AbstractEventLoop, _LoopServing] = {}

    def start(self) -> GatewayServer:
        if self._socket is None:
            try:
                self._socket = socket.create_server((self.host, self.port), backlog=BACKLOG,
                                                    family=socket.AF_INET6 if ":" in self.host else socket.AF_INET)
            except OSError as err:
                raise RuntimeError(f"the agent gateway cannot listen on {self.host}:{self.port} (rollout.agent.host, "
                                   f"rollout.agent.port): {err.strerror}") from None
            self.port = self._socket.getsockname()[1]
            logger.info("agent gateway listening on http://%s:%d", self.host, self.port)
        return self

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    @contextlib.asynccontextmanager
    async def serving(self):
        """Serve from the running event loop until the last episode inside this context leaves it."""
        loop = asyncio.get_running_loop()
        serving = self._loops.setdefault(loop, _LoopServing())
        serving.inside += 1
        try:
            async with serving.lock:
                if serving.runner is None:
                    serving.runner = web.AppRunner(_app(self), access_log=None, handle_signals=False)
                    await serving.runner.setup()
                    # A duplicate of the socket: the site closes its own when the loop's serving ends.
                    await web.SockSite(serving.runner, self._socket.dup()).start()
            yield
        finally:
            serving.inside -= 1
            if serving.inside == 0:
                async with serving.lock:
                    if serving.inside == 0 and serving.runner is not None:
                        runner, serving.runner = serving.runner, None
                        await runner.cleanup()
                        self._loops.pop(loop, None)

    def open(self, episode: Episode) -> str:
        """Make `episode` reachable; its base URL."""
        self._episodes[episode.id] = episode
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/episodes/{episode.id}/v1"

    def close_episode(self, episode: Episode) -> None:
        self._episodes.pop(episode.id, None)

    def episode(self, episode_id: str) -> Episode:
        found = self._episodes.get(episode_id)
        if found is None:
            raise ApiError(f"no episode {episode_id!r} is running: use the base_url your agent function was given "
                           "(each episode's own, valid while the function runs)", None, "episode_not_found", 404)
        return found


class _LoopServing:
    def __init__(self):
        self.inside = 0
        self.lock = asyncio.Lock()
        self.runner: web.AppRunner | None = None


def _app(gateway: GatewayServer) -> web.Application:
    def generation(parse, method: str, chunks):
        """A handler of one of the two generating endpoints: the request parsed, the episode's `method` called, the
        answer as JSON or as a stream of `chunks`."""
        async def handle(request: web.Request) -> web.StreamResponse:
            parsed = parse(await _body(request), gateway.sampling)
            episode = gateway.episode(request.match_info["episode_id"])
            response = await _call(getattr(episode, method)(parsed))
            if parsed.options.stream:
                return _events(chunks(response, parsed.options.include_usage))
            return web.json_response(response)

        return handle

    async def models(request: web.Request) -> web.StreamResponse:
        gateway.episode(request.match_info["episode_id"])
        return web.json_response(models_list(gateway.model))

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        raise ApiError(f"{request.path} is not served: the gateway serves episodes only, at the base_url your agent "
                       "function was given (http://host:port/episodes/<id>/v1)", None, "not_found", 404)

    @web.middleware
    async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status)
        except web.HTTPException as error:  # aiohttp's own (a wrong method on a known path): OpenAI's shape too
            return web.json_response(ApiError(error.reason, None, None, error.status).body(), status=error.status)
        except Exception as error:  # noqa: BLE001 - answered as a server error; the run goes on
            logger.exception("agent gateway: a call failed")
            return web.json_response(ApiError(f"{type(error).__name__}: {error}", status=500,
                                              kind="server_error").body(), status=500)

    app = web.Application(middlewares=[openai_errors], client_max_size=64 << 20)
    app.router.add_post("/episodes/{episode_id}/v1/chat/completions",
                        generation(parse_chat_request, "chat", chat_chunks))
    app.router.add_post("/episodes/{episode_id}/v1/completions",
                        generation(parse_completion_request, "complete", text_chunks))
    app.router.add_get("/episodes/{episode_id}/v1/models", models)
    app.router.add_route("*", "/{path:.*}", elsewhere)
    return app


async def _call(call):
    """The episode's call, shielded: a client that hangs up leaves it to finish and be recorded."""
    try:
        return await asyncio.shield(call)
    except EpisodeEnded as ended:
        raise ApiError(f"episode {ended} has ended", None, "episode_not_found", 404) from None


async def _body(request: web.Request):
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(f"the request body is not valid JSON: {err}", None, "invalid_json") from None


def _events(chunks: list[dict]) -> web.Response:
    return web.Response(text=server_sent_events(chunks), content_type="text/event-stream")
