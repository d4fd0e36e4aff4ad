"""The OpenAPI document (`/openapi.json`): what it says, a client generated from it
(openapi-python-client) talking to the running service, and a bounded fuzz of the
running service against it (schemathesis): no 5xx, every status, content type, header
and body — the SSE events included — as documented.

`make fuzz` runs the fuzz longer: `FUZZ_MAX_EXAMPLES` (default 20 here) and `FUZZ_SEED`.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import io
import json
import os
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from requests.structures import CaseInsensitiveDict
from schemathesis.engine import StopReason, events, from_schema

from app.errors import (
    ClientDisconnected,
    DatabaseUnavailable,
    EcoscanError,
    FollowerLimit,
    InternalError,
    NotFound,
    Overloaded,
    RequestRejected,
    ScanAlreadyFinished,
    ScanConflict,
    ScanEventsGone,
    ScanNotFound,
    ScanRunningElsewhere,
    Unauthorized,
)
from app.http.openapi.errors import (
    CHARACTERS_ERRORS,
    IDENTITY_REFUSALS,
    SCAN_CANCEL_ERRORS,
    SCAN_EVENTS_ERRORS,
    SCAN_STATUS_ERRORS,
    scan_refusals,
)
from app.http.openapi.requests import EXAMPLE_DATA_URL
from app.main import create_app
from app.settings import Settings
from app.stages.order import stage_names

from .conftest import SCAN_URL, Service, data_url, make_jpeg, run_scan

FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "20261122"))
FUZZ_MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "20"))
FUZZ_CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
]
EXAMPLE_PNG = base64.b64decode(EXAMPLE_DATA_URL.split(",", 1)[1])
SCAN_RESOURCE = "/api/v1/scan/{job_id}"
CHARACTERS_URL = "/api/v1/users/me/characters"


async def openapi(service: Service) -> dict[str, Any]:
    response = await service.client.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = document
        for part in ref[2:].split("/"):
            target = target[part]
        node = target
    return node


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def subclasses(cls: type[EcoscanError]) -> Iterator[type[EcoscanError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)


# --- the document --------------------------------------------------------------------


async def test_scan_request_bodies_and_header(service: Service) -> None:
    document = await openapi(service)
    operation = document["paths"][SCAN_URL]["post"]
    assert set(document["paths"][SCAN_URL]) == {"post"}

    body = operation["requestBody"]
    assert body["required"] is True
    assert set(body["content"]) == {"application/json", "multipart/form-data"}

    as_json = resolve(document, body["content"]["application/json"]["schema"])
    assert as_json["type"] == "object"
    assert as_json["required"] == ["image_url"]
    assert as_json["properties"]["image_url"]["type"] == "string"
    user_input = as_json["properties"]["user_input"]
    assert user_input == {**user_input, "type": "string", "maxLength": service.settings.user_input_max_chars}

    upload = resolve(document, body["content"]["multipart/form-data"]["schema"])
    assert upload["required"] == ["image"]
    assert upload["properties"]["image"] == {
        **upload["properties"]["image"],
        "type": "string",
        "format": "binary",
    }
    assert upload["properties"]["user_input"]["maxLength"] == service.settings.user_input_max_chars

    user_id, key = operation["parameters"]
    assert (user_id["name"], user_id["in"], user_id["required"]) == ("X-User-ID", "header", False)
    assert user_id["schema"] == {"type": "string", "maxLength": 128}
    assert (key["name"], key["in"], key["required"]) == ("Idempotency-Key", "header", False)
    assert key["schema"] == {"type": "string", "minLength": 1, "maxLength": 128}
    # AUTH_MODE=jwt: an optional bearer token (anonymous callers where allowed).
    assert operation["security"] == [{}, {"bearerAuth": []}]
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        **document["components"]["securitySchemes"]["bearerAuth"],
        "type": "http",
        "scheme": "bearer",
    }


async def test_scan_stream_response(service: Service) -> None:
    document = await openapi(service)
    ok = document["paths"][SCAN_URL]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"text/event-stream"}
    assert ok["headers"]["X-Scan-Id"]["required"] is True
    assert ok["headers"]["X-Scan-Token"]["required"] is False  # anonymous scans only
    assert ok["headers"]["Idempotent-Replayed"]["required"] is False
    assert ok["headers"]["Idempotent-Replayed"]["schema"]["enum"] == ["true"]
    item = ok["content"]["text/event-stream"]["itemSchema"]
    assert item["properties"]["event"]["enum"] == [
        "stage",
        "items",
        "item",
        "item_rule",
        "delta",
        "discard",
        "done",
        "error",
    ]
    by_event = {
        branch["properties"]["event"]["const"]: branch["properties"]["data"] for branch in item["oneOf"]
    }
    assert set(by_event) == {"stage", "items", "item", "item_rule", "delta", "discard", "done", "error"}
    for data in by_event.values():
        assert data["contentMediaType"] == "application/json"

    def schema_of(event: str) -> dict[str, Any]:
        return resolve(document, by_event[event]["contentSchema"])

    common = {"job_id", "step", "seq", "progress"}
    assert set(schema_of("done")["required"]) == common | {
        "classification",
        "item_name",
        "situation_tags",
        "disposal_rules",
        "disposal_rules_reason",
        "items",
        "items_dropped",
        "item_rules",
        "answer",
        "reward",
        "upstreams",
        "timings",
    }
    assert set(schema_of("items")["required"]) == common | {"count", "main", "dropped"}
    assert set(schema_of("item")["required"]) == common | {
        "index",
        "main",
        "classification",
        "item_name",
        "situation_tags",
        "box",
    }
    assert set(schema_of("item_rule")["required"]) == common | {"index", "disposal_rules", "reason"}
    assert set(schema_of("error")["required"]) == common | {"code", "message", "retryable"}
    assert set(schema_of("delta")["required"]) == common | {"text"}
    stages = [resolve(document, ref) for ref in by_event["stage"]["contentSchema"]["oneOf"]]
    assert {s["properties"]["status"]["const"] for s in stages} == {"started", "completed"}
    completed = {s["properties"]["step"].get("const"): s for s in stages if "duration_ms" in s["properties"]}
    assert set(completed) == set(stage_names())
    assert {"classification", "item_name", "situation_tags"} <= set(completed["vision"]["required"])
    assert {"disposal_rules", "reason"} <= set(completed["rule"]["required"])


async def test_scan_errors_come_from_the_error_tree(service: Service) -> None:
    document = await openapi(service)
    responses = document["paths"][SCAN_URL]["post"]["responses"]
    error = document["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"detail", "code"}
    codes = error["properties"]["code"]["enum"]

    # Every client mistake and admission refusal the scan endpoint can answer with: all
    # but a 499 and the refusals of reading / cancelling a scan (a POST repeating an
    # earlier one with its Idempotency-Key can meet SCAN_RUNNING_ELSEWHERE and, following it
    # there, FOLLOWER_LIMIT).
    resource_only = (ScanNotFound, ScanConflict, ScanAlreadyFinished, ScanEventsGone)
    refusals = [
        cls
        for base in (RequestRejected, Overloaded)
        for cls in subclasses(base)
        if cls not in (ClientDisconnected, NotFound, *resource_only)
    ]
    assert ScanRunningElsewhere in refusals and FollowerLimit in refusals
    assert set(refusals) <= set(scan_refusals())
    for cls in [*refusals]:
        response = responses[str(cls.status)]
        assert f"`{cls.code}`" in response["description"], (cls, response["description"])
        assert cls.code in codes
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert {"400", "401", "409", "413", "415", "422", "429", "500", "503"} <= set(responses)
    assert "499" not in responses and "404" not in responses
    assert "CLIENT_DISCONNECTED" not in codes
    assert "`IDEMPOTENCY_KEY_REUSED`" in responses["422"]["description"]
    # A repeated POST reads its earlier scan from the database: a failure there is a 503.
    assert "`DATABASE_UNAVAILABLE`" in responses["503"]["description"]
    for status in ("429", "503"):
        retry_after = responses[status]["headers"]["Retry-After"]
        assert retry_after["required"] is True
        assert retry_after["schema"]["type"] == "integer"
    assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True


async def test_other_endpoints(service: Service) -> None:
    document = await openapi(service)
    paths = document["paths"]
    assert set(paths) == {
        SCAN_URL,
        "/api/v1/scan/categories",
        SCAN_RESOURCE,
        SCAN_RESOURCE + "/events",
        CHARACTERS_URL,
        "/healthz",
        "/readyz",
        "/metrics",
    }

    def json_schema(path: str, status: str) -> dict[str, Any]:
        content = paths[path]["get"]["responses"][status]["content"]
        assert set(content) == {"application/json"}
        return resolve(document, content["application/json"]["schema"])

    categories = json_schema("/api/v1/scan/categories", "200")
    assert set(categories["required"]) == {"majors", "situation_tags", "paths", "path_separator"}
    assert json_schema("/healthz", "200")["required"] == ["status"]
    assert json_schema("/readyz", "200") == json_schema("/readyz", "503")
    assert set(json_schema("/readyz", "200")["required"]) == {"ready", "checks"}
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert metrics == {"text/plain": {"schema": {"type": "string"}}}


def documented_errors(
    document: dict[str, Any], responses: dict[str, Any], classes: list[type[EcoscanError]]
) -> None:
    """Every error of `classes` is documented under its status, as an `Error` with its code
    (and the header its status needs); and no other status but 2xx."""
    codes = document["components"]["schemas"]["Error"]["properties"]["code"]["enum"]
    for cls in classes:
        response = responses[str(cls.status)]
        assert f"`{cls.code}`" in response["description"], (cls, response["description"])
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
        assert cls.code in codes
        if issubclass(cls, Unauthorized):
            assert response["headers"]["WWW-Authenticate"]["required"] is True
        if issubclass(cls, Overloaded):
            assert response["headers"]["Retry-After"]["required"] is True
    assert {s for s in responses if not s.startswith("2")} == {str(cls.status) for cls in classes}


async def test_scans_as_resources(service: Service) -> None:
    document = await openapi(service)
    resource, events = document["paths"][SCAN_RESOURCE], document["paths"][SCAN_RESOURCE + "/events"]
    assert set(resource) == {"get", "delete"} and set(events) == {"get"}
    post = document["paths"][SCAN_URL]["post"]

    def parameters(operation: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        found = {(p["in"], p["name"]): p for p in operation["parameters"]}
        assert len(found) == len(operation["parameters"]), "a parameter is documented twice"
        return found

    for operation in (resource["get"], resource["delete"], events["get"]):
        params = parameters(operation)
        assert params[("path", "job_id")]["schema"] == {"type": "string", "format": "uuid"}
        assert params[("path", "job_id")]["required"] is True
        assert params[("header", "X-User-ID")] == {**params[("header", "X-User-ID")], "required": False}
        assert params[("header", "X-Scan-Token")]["required"] is False
        assert params[("query", "token")]["required"] is False
        assert operation["security"] == [{}, {"bearerAuth": []}]
        assert operation["responses"]["404"]["description"].count("`SCAN_NOT_FOUND`") == 1
    params = parameters(events["get"])
    assert params[("query", "after")]["schema"] == {"type": "integer", "minimum": 0, "maximum": 999_999_999}
    assert params[("header", "Last-Event-ID")]["schema"]["type"] == "string"

    # GET: the status, with the terminal event's data exactly as streamed.
    status = resource["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    status = resolve(document, status)
    assert set(status["required"]) == {"job_id", "status", "created_at", "finished_at"}
    assert status["properties"]["status"]["enum"] == ["running", "completed", "failed", "cancelled"]
    assert status["properties"]["result"]["$ref"] == "#/components/schemas/DoneEvent"
    assert status["properties"]["error"]["$ref"] == "#/components/schemas/ErrorEvent"
    documented_errors(document, resource["get"]["responses"], SCAN_STATUS_ERRORS)

    # Events: the POST's stream, the same event contract.
    ok = events["get"]["responses"]["200"]
    assert set(ok["content"]) == {"text/event-stream"}
    assert ok["headers"]["X-Scan-Id"]["required"] is True
    assert ok["content"] == post["responses"]["200"]["content"]
    documented_errors(document, events["get"]["responses"], SCAN_EVENTS_ERRORS)
    assert "`SCAN_RUNNING_ELSEWHERE`" in events["get"]["responses"]["409"]["description"]

    # DELETE: 202, or 409 for a scan that has ended / runs elsewhere.
    delete = resource["delete"]["responses"]
    assert "200" not in delete
    cancelling = resolve(document, delete["202"]["content"]["application/json"]["schema"])
    assert set(cancelling["required"]) == {"job_id", "status"}
    assert cancelling["properties"]["status"]["const"] == "cancelling"
    documented_errors(document, delete, SCAN_CANCEL_ERRORS)
    for code in ("SCAN_FINISHED", "SCAN_RUNNING_ELSEWHERE"):
        assert f"`{code}`" in delete["409"]["description"]

    # The identity layer's refusals, wherever it is asked who calls; the store's failures
    # while a scan is read are 503 DATABASE_UNAVAILABLE.
    for errors in (SCAN_STATUS_ERRORS, SCAN_EVENTS_ERRORS, SCAN_CANCEL_ERRORS, CHARACTERS_ERRORS):
        assert set(IDENTITY_REFUSALS) <= set(errors)
    assert {DatabaseUnavailable, InternalError} <= set(SCAN_STATUS_ERRORS) & set(SCAN_CANCEL_ERRORS)

    # The caller's collection.
    mine = document["paths"][CHARACTERS_URL]
    assert set(mine) == {"get"}
    collection = resolve(document, mine["get"]["responses"]["200"]["content"]["application/json"]["schema"])
    assert collection["required"] == ["characters"]
    owned = resolve(document, collection["properties"]["characters"]["items"])
    assert set(owned["required"]) == {"code", "name", "dialog", "acquired_at", "scan_id"}
    documented_errors(document, mine["get"]["responses"], CHARACTERS_ERRORS)
    assert DatabaseUnavailable in CHARACTERS_ERRORS
    assert "`UNAUTHENTICATED`" in mine["get"]["responses"]["401"]["description"]


async def test_valid_openapi_3_1_but_for_the_event_stream_item_schema(service: Service) -> None:
    """OpenAPI 3.1 has no keyword for one item of a stream: the document borrows 3.2's
    `itemSchema` (as FastAPI does for its own SSE routes). Everything else is valid 3.1
    and every `$ref` resolves."""
    document = await openapi(service)
    assert document["openapi"].startswith("3.1.")
    for ref in set(refs(document)):
        resolve(document, {"$ref": ref})
    for path, method in ((SCAN_URL, "post"), (SCAN_RESOURCE + "/events", "get")):
        stream = document["paths"][path][method]["responses"]["200"]["content"]["text/event-stream"]
        del stream["itemSchema"]
    schemathesis.openapi.from_dict(document).validate()


def test_document_follows_the_settings() -> None:
    # create_app builds no resources (the lifespan does): the document needs none.
    document = create_app(Settings(user_input_max_chars=42)).openapi()
    schemas = document["components"]["schemas"]
    assert schemas["ScanRequest"]["properties"]["user_input"]["maxLength"] == 42
    assert schemas["ScanUpload"]["properties"]["user_input"]["maxLength"] == 42


# --- a generated client ------------------------------------------------------------------

CLIENT_PACKAGE = "ecoscan_openapi_client"


@pytest.fixture
async def generated_client(service: Service, tmp_path: Path) -> Any:
    """The package openapi-python-client generates from /openapi.json, imported.
    Offline: from a file, and with no post hooks (by default it runs `ruff`)."""
    document_path = tmp_path / "openapi.json"
    document_path.write_text(json.dumps(await openapi(service)))
    config_path = tmp_path / "openapi-python-client.json"
    config_path.write_text(json.dumps({"post_hooks": []}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "openapi_python_client",
        "generate",
        "--path",
        str(document_path),
        "--config",
        str(config_path),
        "--meta",
        "none",
        "--output-path",
        str(tmp_path / CLIENT_PACKAGE),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    log = output.decode(errors="replace")
    assert process.returncode == 0, log
    # The generator reports what it could not generate as warnings; there must be none.
    assert "Warning" not in log and "Unable to" not in log, log
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(CLIENT_PACKAGE)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == CLIENT_PACKAGE or n.startswith(CLIENT_PACKAGE + ".")]:
            del sys.modules[name]


def sse_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if "data" in fields:
            events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


async def test_generated_client_scans(generated_client: Any, service: Service) -> None:
    scan = importlib.import_module(f"{CLIENT_PACKAGE}.api.scan.scan_classify_completion")
    models = importlib.import_module(f"{CLIENT_PACKAGE}.models")
    types = importlib.import_module(f"{CLIENT_PACKAGE}.types")
    jpeg = make_jpeg(21)

    async with generated_client.Client(base_url=service.url, timeout=30.0) as client:
        # JSON body: the stream comes back as text (the client does not parse SSE).
        response = await scan.asyncio_detailed(
            client=client,
            body=models.ScanRequest(image_url=data_url(jpeg), user_input="라벨은 떼야 하나요?"),
            x_user_id="openapi-client",
        )
        assert response.status_code == 200, response.content
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.parsed == response.content.decode()
        streamed = sse_events(response.content)
        assert streamed[-1][0] == "done", streamed[-1]
        assert streamed[-1][1]["job_id"] == response.headers["x-scan-id"]
        assert streamed[-1][1]["classification"]["major"]

        # Multipart body.
        upload = models.ScanUpload(
            image=types.File(payload=io.BytesIO(jpeg), file_name="bottle.jpg", mime_type="image/jpeg"),
            user_input="어떻게 버려요?",
        )
        response = await scan.asyncio_detailed(client=client, body=upload)
        assert response.status_code == 200, response.content
        assert sse_events(response.content)[-1][0] == "done"
        anonymous_id, token = uuid.UUID(response.headers["x-scan-id"]), response.headers["x-scan-token"]

        # A refusal parses into the Error model, its code into the generated enum.
        response = await scan.asyncio_detailed(
            client=client, body=models.ScanRequest(image_url="https://localhost/bottle.jpg")
        )
        assert response.status_code == 422
        assert response.parsed.code == models.ErrorCode.IMAGE_URL_REJECTED

        # The JSON endpoints' real answers parse into their generated models.
        categories = importlib.import_module(f"{CLIENT_PACKAGE}.api.scan.list_categories")
        taxonomy = await categories.asyncio(client=client)
        assert isinstance(taxonomy, models.Categories) and taxonomy.paths
        readyz = importlib.import_module(f"{CLIENT_PACKAGE}.api.operations.readyz")
        ready = await readyz.asyncio(client=client)
        assert isinstance(ready, models.Readiness) and ready.ready is True

        # Scans as resources. The status parses into ScanStatus, its result into DoneEvent.
        get_scan = importlib.import_module(f"{CLIENT_PACKAGE}.api.scan.get_scan")
        job_id = uuid.UUID(streamed[-1][1]["job_id"])
        status = await get_scan.asyncio(client=client, job_id=job_id, x_user_id="openapi-client")
        assert isinstance(status, models.ScanStatus), status
        assert status.status == models.ScanStatusStatus.COMPLETED
        assert status.result.to_dict() == streamed[-1][1]
        # An anonymous scan, with its token; without it, 404 parses into Error.
        status = await get_scan.asyncio(client=client, job_id=anonymous_id, x_scan_token=token)
        assert isinstance(status, models.ScanStatus) and status.result.job_id == anonymous_id
        missing = await get_scan.asyncio(client=client, job_id=anonymous_id)
        assert isinstance(missing, models.Error) and missing.code == models.ErrorCode.SCAN_NOT_FOUND

        # Its events from Last-Event-ID on, as text, as the POST's.
        scan_events = importlib.import_module(f"{CLIENT_PACKAGE}.api.scan.get_scan_events")
        response = await scan_events.asyncio_detailed(
            client=client, job_id=job_id, x_user_id="openapi-client", last_event_id="3"
        )
        assert response.status_code == 200, response.content
        assert sse_events(response.content) == streamed[3:]

        # Cancelling a finished scan: 409.
        cancel = importlib.import_module(f"{CLIENT_PACKAGE}.api.scan.cancel_scan")
        refused = await cancel.asyncio(client=client, job_id=job_id, x_user_id="openapi-client")
        assert isinstance(refused, models.Error) and refused.code == models.ErrorCode.SCAN_FINISHED

        # The caller's collection; an anonymous caller has none (401).
        characters = importlib.import_module(f"{CLIENT_PACKAGE}.api.users.my_characters")
        mine = await characters.asyncio(client=client, x_user_id="openapi-client")
        assert isinstance(mine, models.CharacterCollection), mine
        assert all(c.scan_id == job_id for c in mine.characters)
        nobody = await characters.asyncio_detailed(client=client)
        assert nobody.status_code == 401 and nobody.headers["www-authenticate"] == "Bearer"
        assert nobody.parsed.code == models.ErrorCode.UNAUTHENTICATED


# --- the fuzz ----------------------------------------------------------------------------


def fuzz_config() -> dict[str, Any]:
    return {
        "seed": FUZZ_SEED,
        "generation": {"max-examples": FUZZ_MAX_EXAMPLES, "database": "none"},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in FUZZ_CHECKS}},
        # No links between operations: nothing for the stateful phase to chain.
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": 15,
        # Read every event stream to its end, so the `done` / `error` event is checked too.
        "max-stream-events": 100_000,
        "continue-on-failure": True,
    }


def with_valid_images(_context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """Half the bodies carry a valid image instead of the generated one (which hardly
    ever is), so that random `user_input`s and `X-User-ID`s reach the scan itself."""
    if isinstance(body, dict) and "image_url" in body:
        return st.sampled_from([body, {**body, "image_url": EXAMPLE_DATA_URL}])
    if isinstance(body, dict) and "image" in body:
        return st.sampled_from([body, {**body, "image": EXAMPLE_PNG}])
    return st.just(body)


@dataclass(frozen=True)
class KnownScan:
    """A scan that exists, and what shows its owner: a user id, or its token (in a header
    or in the query)."""

    job_id: str
    events: int
    headers: dict[str, str] = field(default_factory=dict)
    query: dict[str, str] = field(default_factory=dict)


FUZZ_OWNER = "fuzz-owner"


async def known_scans(service: Service) -> list[KnownScan]:
    """A finished scan of `FUZZ_OWNER`'s and an anonymous one, for the fuzz to read back."""
    owned = await run_scan(
        service.client, json={"image_url": data_url(make_jpeg(901))}, headers={"X-User-ID": FUZZ_OWNER}
    )
    anonymous = await run_scan(service.client, json={"image_url": data_url(make_jpeg(902))})
    assert owned.status == anonymous.status == 200
    anonymous_id, token = anonymous.headers["x-scan-id"], anonymous.headers["x-scan-token"]
    return [
        KnownScan(owned.headers["x-scan-id"], len(owned.events), headers={"X-User-ID": FUZZ_OWNER}),
        KnownScan(anonymous_id, len(anonymous.events), headers={"X-Scan-Token": token}),
        KnownScan(anonymous_id, len(anonymous.events), query={"token": token}),
    ]


def before_the_end(value: Any, events: int) -> Any:
    """A position (`after`, `Last-Event-ID`) at or past a finished scan's last event,
    moved back before it: a stream from there never ends (the service waits for events
    after the terminal one, pinging, until the client goes away; see the report), which
    would hang the fuzz. Anything else is kept."""
    text = str(value)
    if isinstance(value, bool) or not re.fullmatch("[0-9]+", text) or int(text) < events:
        return value
    moved = int(text) % events
    return moved if isinstance(value, int) else str(moved)


def aimed_at(scans: list[KnownScan]) -> Any:
    """A `flatmap_case` hook: most cases of the scan resources are aimed at a scan that
    exists, shown to be its owner's (so that 200 streams and statuses, and 409s, are
    checked, not only 404s); the rest stay random. Random `after`, `Last-Event-ID`...
    are kept. The collection is asked for, half the time, by `FUZZ_OWNER`."""

    def aim(case: Any, scan: KnownScan | None) -> Any:
        if scan is not None:
            case.path_parameters = {**(case.path_parameters or {}), "job_id": scan.job_id}
            headers = CaseInsensitiveDict({**(case.headers or {}), **scan.headers})
            if "Last-Event-ID" in headers:
                headers["Last-Event-ID"] = before_the_end(headers["Last-Event-ID"], scan.events)
            case.headers = headers
            query = {k: v for k, v in (case.query or {}).items() if k != "token"}
            if "after" in query:
                query["after"] = before_the_end(query["after"], scan.events)
            case.query = {**query, **scan.query}
        return case

    def as_owner(case: Any, owner: bool) -> Any:
        if owner:
            case.headers = CaseInsensitiveDict({**(case.headers or {}), "X-User-ID": FUZZ_OWNER})
        return case

    def hook(context: schemathesis.HookContext, case: Any) -> st.SearchStrategy[Any]:
        path = context.operation.path if context.operation is not None else ""
        if path.startswith(SCAN_RESOURCE):
            return st.sampled_from([None, *scans]).map(lambda scan: aim(case, scan))
        if path == CHARACTERS_URL:
            return st.booleans().map(lambda owner: as_owner(case, owner))
        return st.just(case)

    return hook


def run_fuzz(url: str, scans: list[KnownScan]) -> tuple[StopReason | None, dict[str, int], list[str]]:
    """Schemathesis' engine against the service (in a thread: the service runs on the
    test's event loop). The stop reason, responses by operation and status, and what failed."""
    config = schemathesis.Config.from_dict(fuzz_config())
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    schema.hook("flatmap_body")(with_valid_images)
    schema.hook("flatmap_case")(aimed_at(scans))
    statuses: dict[str, int] = {}
    problems: list[str] = []
    stop_reason = None
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    key = f"{event.recorder.label} {interaction.response.status_code}"
                    statuses[key] = statuses.get(key, 0) + 1
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.failure_info is None:
                        continue
                    failure = check.failure_info.failure
                    failed = event.recorder.interactions.get(case_id)
                    response = failed.response if failed is not None else None
                    answer = f"{response.status_code} {response.content[:500]!r}" if response else "-"
                    problem = (
                        f"{check.name}: {failure.title}\n{failure.message[:1500]}\n"
                        f"request: {check.failure_info.code_sample[:1500]}\nresponse: {answer}"
                    )
                    if problem not in problems:
                        problems.append(problem)
        elif isinstance(event, events.NonFatalError):
            problems.append(f"schemathesis error: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            problems.append(f"schemathesis fatal error: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            stop_reason = event.stop_reason
    return stop_reason, statuses, problems


@pytest.fixture
def hypothesis_home(tmp_path: Path) -> Iterator[None]:
    """Hypothesis' caches go to a temporary directory, not `.hypothesis/` in the tree."""
    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


@pytest.mark.usefixtures("hypothesis_home")
async def test_fuzz_against_the_document(service: Service) -> None:
    scans = await known_scans(service)
    stop_reason, statuses, problems = await asyncio.to_thread(run_fuzz, service.url, scans)
    assert not problems, "\n\n".join(problems)
    assert stop_reason == StopReason.COMPLETED
    # The fuzz reached both sides of the scan endpoint: refusals and whole streams.
    assert statuses.get(f"POST {SCAN_URL} 200", 0) > 0, statuses
    assert sum(n for key, n in statuses.items() if key.startswith(f"POST {SCAN_URL} 4")) > 0, statuses
    # And of the scan resources: real scans read back (statuses, replayed streams), and
    # random ids (404).
    for operation in (f"GET {SCAN_RESOURCE}", f"GET {SCAN_RESOURCE}/events"):
        assert statuses.get(f"{operation} 200", 0) > 0, statuses
    for operation in (f"GET {SCAN_RESOURCE}", f"GET {SCAN_RESOURCE}/events", f"DELETE {SCAN_RESOURCE}"):
        assert statuses.get(f"{operation} 404", 0) > 0, statuses
