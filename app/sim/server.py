"""The simulator's Starlette app and an in-process runner for tests and benchmarks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.runtime.serving import serve_in_loop
from app.sim.completions import ChatCompletions
from app.sim.config import SimConfig
from app.sim.models import listed_models
from app.sim.state import SimState

CHAT_PATH = "/v1/chat/completions"


class SimApp(Starlette):
    """Starlette, except chat completions skip the middleware stack.

    A streamed response resumes its coroutine once per chunk, and each resume (and each
    ``send``) would otherwise pass through Starlette's error/exception middleware frames.
    """

    def __init__(self, chat: ChatCompletions, routes: list[Route]) -> None:
        super().__init__(routes=routes, exception_handlers={HTTPException: _http_error})
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH and scope["method"] == "POST":
            await self.chat(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_sim_app(config: SimConfig) -> Starlette:
    """The simulator as a Starlette app; its ``SimState`` is ``app.state.sim``."""
    state = SimState(config)
    chat = ChatCompletions(state)

    async def models(_: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": 1_715_367_049, "owned_by": "system"}
            for name in listed_models()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def get_requests(_: Request) -> Response:
        return JSONResponse(list(state.captured))

    async def reset_requests(_: Request) -> Response:
        state.captured.clear()
        return JSONResponse([])

    async def get_stats(_: Request) -> Response:
        return JSONResponse(state.stats.snapshot())

    async def reset_stats(_: Request) -> Response:
        state.stats.reset()
        return JSONResponse(state.stats.snapshot())

    async def get_config(_: Request) -> Response:
        return JSONResponse(state.config.to_dict())

    async def patch_config(request: Request) -> Response:
        try:
            changes = json.loads(await request.body())
        except ValueError:
            return _config_error("body is not valid JSON")
        if not isinstance(changes, dict):
            return _config_error("body must be a JSON object of SimConfig fields")
        try:
            config = state.configure(changes)
        except ValueError as exc:
            return _config_error(str(exc))
        return JSONResponse(config.to_dict())

    app = SimApp(
        chat,
        [
            Route(CHAT_PATH, chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/sim/stats", get_stats, methods=["GET"]),
            Route("/sim/stats/reset", reset_stats, methods=["POST"]),
            Route("/sim/config", get_config, methods=["GET"]),
            Route("/sim/config", patch_config, methods=["PATCH"]),
            Route("/sim/requests", get_requests, methods=["GET"]),
            Route("/sim/requests/reset", reset_requests, methods=["POST"]),
        ],
    )
    app.state.sim = state
    return app


def _config_error(message: str) -> Response:
    field = message.split(" ", 1)[0].rstrip(":")
    error = {"message": message, "type": "invalid_request_error", "param": field, "code": None}
    return JSONResponse({"error": error}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"Invalid URL ({request.method} {request.url.path})"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=status)


@dataclass(frozen=True)
class RunningSimulator:
    """A started simulator: ``base_url`` is what an OpenAI client wants (ends in ``/v1``)."""

    host: str
    port: int
    state: SimState
    app: Starlette

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@contextlib.asynccontextmanager
async def run_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningSimulator]:
    """Serve the simulator in the current event loop for the duration of the block."""
    app = create_sim_app(config)
    state: SimState = app.state.sim
    async with serve_in_loop(app, host, port) as url:
        try:
            yield RunningSimulator(host=host, port=urlsplit(url).port or port, state=state, app=app)
        finally:
            # Injected stalls end at once, so shutdown does not wait for them.
            state.closing.set()
