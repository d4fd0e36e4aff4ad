"""`install_openapi`: the app's `openapi()`, FastAPI's document of the routes plus the
schemas no route declares as a model (request bodies, the event stream's events), for
this deployment's settings and stage list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from app.http.openapi.common import REF
from app.http.openapi.events import event_models, sse_item_schema, stream_description
from app.http.openapi.operations import SECURITY_SCHEMES, scan_status_model
from app.http.openapi.requests import scan_request_schema, scan_upload_schema
from app.settings import Settings
from app.stages.base import StageClass

API_DESCRIPTION = """\
Photograph an item of waste; ecoscan tells you how to dispose of it (Korean household
waste sorting). `POST /api/v1/scan/classify/completion` streams each stage of a scan
over Server-Sent Events; `/api/v1/scan/{job_id}` reads a scan back (status, its events
from any point on, cancelling it). Every JSON error is `{"detail", "code"}` (`Error`)."""

EVENT_STREAM = "text/event-stream"


def document_schemas(settings: Settings, stages: Sequence[StageClass]) -> dict[str, Any]:
    """The component schemas no route declares as a model."""
    events = event_models(stages)
    status = scan_status_model(events["done"][0], events["error"][0])
    models = [*(m for group in events.values() for m in group), status]
    _, top = models_json_schema([(m, "serialization") for m in models], ref_template=REF + "{model}")
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["ScanRequest"] = scan_request_schema(settings)
    schemas["ScanUpload"] = scan_upload_schema(settings)
    return schemas


def build_openapi(app: FastAPI, settings: Settings, stages: Sequence[StageClass]) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=API_DESCRIPTION,
        routes=app.routes,
    )
    _merge_parameters(document)
    _describe_event_streams(document, stages)
    components = document.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    schemas = components.setdefault("schemas", {})
    for name, schema in document_schemas(settings, stages).items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"two different schemas named {name} in the OpenAPI document")
        schemas[name] = schema
    components["schemas"] = dict(sorted(schemas.items()))
    return document


def _describe_event_streams(document: dict[str, Any], stages: Sequence[StageClass]) -> None:
    """Every `text/event-stream` response gets this app's `itemSchema`, and its
    description the fields this stage list's events carry."""
    item = sse_item_schema(event_models(stages))
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            for response in operation.get("responses", {}).values():
                stream = response.get("content", {}).get(EVENT_STREAM)
                if stream is not None:
                    stream["itemSchema"] = item
                    response["description"] = stream_description(response["description"], stages)


def _merge_parameters(document: dict[str, Any]) -> None:
    """One parameter per name and location: a route's `openapi_extra` parameters are
    appended to those FastAPI derives from its signature (`job_id`); the later, written
    for the document, wins, in the place of the first."""
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            merged: dict[tuple[str, str], dict[str, Any]] = {}
            for parameter in operation.get("parameters", []):
                name = parameter["name"].lower() if parameter["in"] == "header" else parameter["name"]
                merged[(parameter["in"], name)] = parameter
            if merged:
                operation["parameters"] = list(merged.values())


def install_openapi(app: FastAPI, settings: Settings, stages: Sequence[StageClass]) -> None:
    """Make `app.openapi()` (and so `/openapi.json`) the document above."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, settings, stages)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
