"""Application factory. `create_app(settings)` builds the app; the module-level
`app` exists only so that `uvicorn app.main:app` works, and creates no resources
(the lifespan does, when the server starts)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.http.docs_page import router as docs_router
from app.http.early_refusal import STATE_KEY, EarlyRefusal
from app.http.errors import install_error_handlers
from app.http.head_limits import HeadLimits
from app.http.openapi.document import install_openapi
from app.http.page import router as page_router
from app.http.routes import router
from app.resources import Resources, lifespan_resources
from app.runtime.heap import timed_collections, tuned_heap
from app.runtime.metrics import Metrics
from app.runtime.redaction import scrub_access_log
from app.scans.drain import SignalRouter
from app.settings import Settings
from app.stages.base import StageClass
from app.stages.order import STAGES

log = logging.getLogger("app")


def create_app(
    settings: Settings | None = None, *, metrics: Metrics | None = None, stages: Sequence[StageClass] = STAGES
) -> FastAPI:
    """`stages`: the scan's stages, in order (app/stages/order.py; tests pass their own)."""
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        _configure_logging(settings.log_level)
        async with lifespan_resources(settings, metrics, stages) as resources:
            signals = SignalRouter(resources.drain, asyncio.get_running_loop())
            if signals.install():
                log.info("SIGTERM/SIGINT drain in-flight scans for up to %.0f s", settings.shutdown_drain_s)
            log.info("ecoscan ready")
            try:
                with (
                    # Start-up objects frozen from here; full collections wait out crowds.
                    tuned_heap(settings.gc_young_threshold, in_flight=lambda: resources.admission.in_flight),
                    timed_collections(resources.metrics.observe_gc_pause),
                ):
                    yield {"resources": resources, STATE_KEY: _early_refusal(resources)}
            finally:
                signals.restore()

    # /docs is ours (app/http/docs_page.py): FastAPI's loads swagger-ui from a CDN.
    app = FastAPI(title="ecoscan", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(router)
    app.include_router(page_router)
    app.include_router(docs_router)
    install_openapi(app, settings, stages)
    install_error_handlers(app, routers=(router, page_router, docs_router))
    # Heads over the bounds are refused even when the server was started without
    # app/http/protocol.py (a bare `uvicorn app.main:app`).
    app.add_middleware(HeadLimits)
    return app


def _early_refusal(resources: Resources) -> EarlyRefusal | None:
    """What the HTTP protocol asks before a scan reaches the app (app/http/early_refusal.py):
    only the loop pacer refuses there, so nothing without it."""
    if not resources.acceptance.paced:
        return None
    return EarlyRefusal(resources.acceptance.refused_early, resources.acceptance.charge_shed)


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("app").setLevel(level.upper())
    # httpx logs every request at INFO (the JWKS fetches of AUTH_MODE=jwt).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Scan tokens (`?token=`) are capabilities: uvicorn's access line shows them masked.
    scrub_access_log()


app = create_app()
