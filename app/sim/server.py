"""The simulator's ASGI apps and an in-process runner for tests, benchmarks and the service.

One simulator is one upstream (an OpenAI organisation, an Azure resource, a Gemini
project) with its own flavour, limits, state and stats. It listens on two ports: the API
port serves the provider's paths (and ``/sim/*``), the control port serves only ``/sim/*``
and stays up when the ``refuse`` outage closes the API port. Several simulators run side
by side in one loop (``run_simulator`` each, or ``python -m app.sim --upstreams FILE``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.sim.completions import ChatCompletions, send_json
from app.sim.config import SimConfig
from app.sim.flavors import FLAVORS, Failure, flavor_of
from app.sim.listener import Listener, serve
from app.sim.outage import hold
from app.sim.state import SimState

log = logging.getLogger("app.sim")


class SimApp(Starlette):
    """``/sim/*`` through Starlette; the provider's own paths routed by the flavour, raw.

    A streamed response resumes its coroutine once per chunk, and each resume (and each
    ``send``) would otherwise pass through Starlette's error/exception middleware frames.
    """

    def __init__(self, state: SimState, routes: list[Route]) -> None:
        super().__init__(routes=routes, exception_handlers={HTTPException: _http_error})
        self.sim = state
        self.chat = ChatCompletions(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/sim/"):
            await super().__call__(scope, receive, send)
            return
        state = self.sim
        if state.config.outage != "none":
            held = await hold(state, scope, receive, send)
            if held is None:
                return
            receive = held
        config = state.config
        flavor = flavor_of(config)
        route = flavor.route(scope["method"], scope["path"], scope["query_string"])
        if isinstance(route, Failure):
            await send_json(send, route.status, route.body, list(route.headers))
            return
        if route.kind == "chat":
            await self.chat(scope, receive, send, route)
            return
        denied = flavor.check_key(scope["headers"], route, config)
        if denied is not None:
            await send_json(send, denied.status, denied.body)
            return
        await send_json(send, 200, flavor.models_body(config))


def _control_routes(state: SimState) -> list[Route]:
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

    async def get_info(_: Request) -> Response:
        flavor = state.config.flavor
        info = {"flavor": flavor, **state.endpoints}
        if "url" in info:
            info["base_url"] = info["url"] + FLAVORS[flavor].base_path
        return JSONResponse(info)

    async def patch_config(request: Request) -> Response:
        try:
            changes = json.loads(await request.body())
        except ValueError:
            return _config_error("body is not valid JSON")
        if not isinstance(changes, dict):
            return _config_error("body must be a JSON object of SimConfig fields")
        old = state.config.outage
        try:
            config = state.configure(changes)
        except ValueError as exc:
            return _config_error(str(exc))
        hook = state.on_outage
        if config.outage == old or hook is None:
            return JSONResponse(config.to_dict())
        if config.outage == "refuse":
            # After the reply: the connection this PATCH came on may be one that gets reset.
            return JSONResponse(config.to_dict(), background=BackgroundTask(hook, old, config.outage))
        try:
            await hook(old, config.outage)
        except OSError as exc:
            state.configure({"outage": old})
            error = {"message": f"outage: cannot listen again: {exc}", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=500)
        return JSONResponse(config.to_dict())

    return [
        Route("/sim/stats", get_stats, methods=["GET"]),
        Route("/sim/stats/reset", reset_stats, methods=["POST"]),
        Route("/sim/config", get_config, methods=["GET"]),
        Route("/sim/config", patch_config, methods=["PATCH"]),
        Route("/sim/info", get_info, methods=["GET"]),
        Route("/sim/requests", get_requests, methods=["GET"]),
        Route("/sim/requests/reset", reset_requests, methods=["POST"]),
    ]


def create_sim_app(config: SimConfig) -> Starlette:
    """The simulator's API app; its ``SimState`` is ``app.state.sim``."""
    state = SimState(config)
    app = SimApp(state, _control_routes(state))
    app.state.sim = state
    return app


def create_control_app(state: SimState) -> Starlette:
    """Only ``/sim/*`` of ``state``: what the control port serves."""
    app = Starlette(routes=_control_routes(state), exception_handlers={HTTPException: _http_error})
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


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class RunningSimulator:
    """A started simulator. ``base_url`` is what an OpenAI client wants for its flavour
    (``/v1``, ``/openai/v1``, ``/v1beta/openai``); ``url`` is the root (Azure's
    ``azure_endpoint``); ``control_url`` reaches ``/sim/*`` even while ``refuse`` is on."""

    host: str
    port: int
    state: SimState
    app: Starlette
    control_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{_shown(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + FLAVORS[self.state.config.flavor].base_path

    @property
    def control_url(self) -> str:
        return f"http://{_shown(self.host)}:{self.control_port}"


@contextlib.asynccontextmanager
async def run_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, control_port: int = 0
) -> AsyncIterator[RunningSimulator]:
    """Serve one simulated upstream in the current event loop for the duration of the block."""
    app = create_sim_app(config)
    state: SimState = app.state.sim
    async with (
        serve(app, host, port) as (api_server, bound_port),
        serve(create_control_app(state), host, control_port) as (_, bound_control),
    ):
        listener = Listener(api_server, host, bound_port)

        async def switch(old: str, new: str) -> None:
            if new == "refuse" and listener.accepting:
                state.stats.connections_reset += listener.stop()
            elif new != "refuse":
                await listener.resume()

        state.on_outage = switch
        running = RunningSimulator(host, bound_port, state, app, bound_control)
        state.endpoints = _endpoints(running)
        if config.outage == "refuse":
            await switch("none", "refuse")
        try:
            yield running
        finally:
            # Injected stalls and held requests end at once, so shutdown does not wait for them.
            state.on_outage = None
            state.closing.set()


def _endpoints(running: RunningSimulator) -> dict[str, str]:
    return {"url": running.url, "control_url": running.control_url}
