"""Application factory. `create_app(settings)` builds the app; the module-level
`app` exists only so that `uvicorn app.main:app` works, and creates no resources
(the lifespan does, when the server starts)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from app.errors import ClientDisconnected, EcoscanError, Overloaded
from app.http.openapi import install_openapi
from app.http.page import router as page_router
from app.http.routes import SCAN_PATH, classify_completion, router
from app.resources import lifespan_resources
from app.runtime.heap import tuned_heap
from app.runtime.metrics import Metrics
from app.scans.drain import SignalRouter
from app.settings import Settings

log = logging.getLogger("app")


def create_app(settings: Settings | None = None, *, metrics: Metrics | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        _configure_logging(settings.log_level)
        async with lifespan_resources(settings, metrics) as resources:
            signals = SignalRouter(resources.drain, asyncio.get_running_loop())
            if signals.install():
                log.info("SIGTERM/SIGINT drain in-flight scans for up to %.0f s", settings.shutdown_drain_s)
            log.info("ecoscan ready")
            try:
                with tuned_heap(settings.gc_young_threshold):  # start-up objects frozen from here
                    yield {"resources": resources}
            finally:
                signals.restore()

    app = EcoscanApp(title="ecoscan", version="0.1.0", lifespan=lifespan)
    app.include_router(router)
    app.include_router(page_router)
    install_openapi(app, settings)
    _install_error_handlers(app)
    return app


class EcoscanApp(FastAPI):
    """FastAPI, with one shortcut: `POST /api/v1/scan/classify/completion`, every scan,
    goes straight to its endpoint. The route stays declared (OpenAPI, docs, any other
    method); its errors are rendered by the functions the app's exception handlers use.
    What the shortcut skips is what this endpoint does not use: route matching over
    every route, dependency solving, and the middleware layers (error, exception, exit
    stack, body limit), two of which wrapped every send of the stream. With FastAPI's
    own OpenTelemetry switched on, scans take the full stack, so they are traced."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == SCAN_PATH
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and not _traced(self)
        ):
            scope["app"] = self
            await _scan_route(Request(scope, receive), send)
            return
        await super().__call__(scope, receive, send)


def _traced(app: FastAPI) -> bool:
    telemetry = getattr(app, "_native_telemetry", None)  # FastAPI's, where it has one
    return telemetry is not None and bool(telemetry.enabled())


async def _scan_route(request: Request, send: Send) -> None:
    try:
        response = await classify_completion(request)
    except EcoscanError as exc:
        response = _ecoscan_error(request, exc)
    except HTTPException as exc:
        response = _http_error(exc)
    except Exception as exc:
        response = _unexpected(request, exc)
    await response(request.scope, request.receive, send)


def error_response(exc: EcoscanError) -> JSONResponse:
    headers = exc.headers()
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.close_connection:
        headers["Connection"] = "close"
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


def _ecoscan_error(request: Request, exc: EcoscanError) -> JSONResponse:
    if isinstance(exc, ClientDisconnected):
        log.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
    resources = getattr(request.state, "resources", None)
    if resources is not None and exc.status >= 400:
        resources.metrics.scans.labels("rejected", exc.code).inc()
    return error_response(exc)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    resources = getattr(request.state, "resources", None)
    if resources is not None:
        resources.metrics.scans.labels("rejected", "INTERNAL_ERROR").inc()
    return JSONResponse({"detail": "Internal error.", "code": "INTERNAL_ERROR"}, status_code=500)


def _http_error(exc: HTTPException) -> JSONResponse:
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
    body = {"detail": exc.detail, "code": code}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def ecoscan_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EcoscanError)
        return _ecoscan_error(request, exc)

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return _http_error(exc)

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": "The request is invalid.", "code": "INVALID_REQUEST"}, status_code=422)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _unexpected(request, exc)

    app.add_exception_handler(EcoscanError, ecoscan_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("app").setLevel(level.upper())
    # httpx logs every request at INFO: two lines per scan, on the hot path.
    logging.getLogger("httpx").setLevel(logging.WARNING)


app = create_app()
