"""A middleware added to the app sees every request, the scan route's POSTs included:
a stream that completes, and a refusal that keeps its JSON error and code."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from fastapi import Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.protocol import HttpToolsProtocol
from app.http.routes import SCAN_PATH
from app.main import create_app
from app.runtime.metrics import Metrics
from app.runtime.serving import serve_in_loop
from app.sim.server import RunningSimulator

from .conftest import data_url, make_jpeg, run_scan, settings_for


class Recorder:
    """A pure ASGI middleware that notes each HTTP request's method and path."""

    def __init__(self, app: ASGIApp, seen: list[tuple[str, str]]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


async def test_middleware_added_to_the_app_sees_the_scan_route(
    database_url: str, sim: RunningSimulator
) -> None:
    app = create_app(settings_for(database_url, sim), metrics=Metrics(process=False))
    pure: list[tuple[str, str]] = []
    decorated: list[tuple[str, str, int]] = []
    app.add_middleware(Recorder, seen=pure)

    @app.middleware("http")
    async def record(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        decorated.append((request.method, request.url.path, response.status_code))
        return response

    async with (
        serve_in_loop(app, lifespan="on", http=HttpToolsProtocol) as url,
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0)) as client,
    ):
        streamed = await run_scan(client, json={"image_url": data_url(make_jpeg(61))})
        refused = await run_scan(client, json={"image_url": "not a picture"})
    assert streamed.terminal.event == "done"
    assert (refused.status, refused.body["code"]) == (422, "INVALID_REQUEST")
    assert pure == [("POST", SCAN_PATH), ("POST", SCAN_PATH)]
    assert decorated == [("POST", SCAN_PATH, 200), ("POST", SCAN_PATH, 422)]
