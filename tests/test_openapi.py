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
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from schemathesis.engine import StopReason, events, from_schema

from app.errors import ClientDisconnected, EcoscanError, NotFound, Overloaded, RequestRejected
from app.main import create_app
from app.openapi import EXAMPLE_DATA_URL, scan_refusals
from app.settings import Settings

from .conftest import SCAN_URL, Service, data_url, make_jpeg

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

    [header] = operation["parameters"]
    assert (header["name"], header["in"], header["required"]) == ("X-User-ID", "header", False)
    assert header["schema"] == {"type": "string", "maxLength": 128}


async def test_scan_stream_response(service: Service) -> None:
    document = await openapi(service)
    ok = document["paths"][SCAN_URL]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"text/event-stream"}
    assert ok["headers"]["X-Scan-Id"]["required"] is True
    item = ok["content"]["text/event-stream"]["itemSchema"]
    assert item["properties"]["event"]["enum"] == ["stage", "delta", "done", "error"]
    by_event = {
        branch["properties"]["event"]["const"]: branch["properties"]["data"] for branch in item["oneOf"]
    }
    assert set(by_event) == {"stage", "delta", "done", "error"}
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
        "answer",
        "reward",
        "timings",
    }
    assert set(schema_of("error")["required"]) == common | {"code", "message", "retryable"}
    assert set(schema_of("delta")["required"]) == common | {"text"}
    stages = [resolve(document, ref) for ref in by_event["stage"]["contentSchema"]["oneOf"]]
    assert {s["properties"]["status"]["const"] for s in stages} == {"started", "completed"}
    completed = {s["properties"]["step"].get("const"): s for s in stages if "duration_ms" in s["properties"]}
    assert set(completed) == {"vision", "rule", "answer", "reward"}
    assert {"classification", "item_name", "situation_tags"} <= set(completed["vision"]["required"])
    assert {"disposal_rules", "reason"} <= set(completed["rule"]["required"])


async def test_scan_errors_come_from_the_error_tree(service: Service) -> None:
    document = await openapi(service)
    responses = document["paths"][SCAN_URL]["post"]["responses"]
    error = document["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"detail", "code"}
    codes = error["properties"]["code"]["enum"]

    # Every client mistake and admission refusal the scan endpoint can answer with.
    refusals = [
        cls
        for base in (RequestRejected, Overloaded)
        for cls in subclasses(base)
        if cls not in (ClientDisconnected, NotFound)
    ]
    assert set(refusals) <= set(scan_refusals())
    for cls in [*refusals]:
        response = responses[str(cls.status)]
        assert f"`{cls.code}`" in response["description"], (cls, response["description"])
        assert cls.code in codes
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert {"400", "413", "415", "422", "429", "500", "503"} <= set(responses)
    assert "499" not in responses
    assert "CLIENT_DISCONNECTED" not in codes
    for status in ("429", "503"):
        retry_after = responses[status]["headers"]["Retry-After"]
        assert retry_after["required"] is True
        assert retry_after["schema"]["type"] == "integer"


async def test_other_endpoints(service: Service) -> None:
    document = await openapi(service)
    paths = document["paths"]
    assert set(paths) == {SCAN_URL, "/api/v1/scan/categories", "/healthz", "/readyz", "/metrics"}

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


async def test_valid_openapi_3_1_but_for_the_event_stream_item_schema(service: Service) -> None:
    """OpenAPI 3.1 has no keyword for one item of a stream: the document borrows 3.2's
    `itemSchema` (as FastAPI does for its own SSE routes). Everything else is valid 3.1
    and every `$ref` resolves."""
    document = await openapi(service)
    assert document["openapi"].startswith("3.1.")
    for ref in set(refs(document)):
        resolve(document, {"$ref": ref})
    stream = document["paths"][SCAN_URL]["post"]["responses"]["200"]["content"]["text/event-stream"]
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


def run_fuzz(url: str) -> tuple[StopReason | None, dict[str, int], list[str]]:
    """Schemathesis' engine against the service (in a thread: the service runs on the
    test's event loop). The stop reason, responses by status, and what failed."""
    config = schemathesis.Config.from_dict(fuzz_config())
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    schema.hook("flatmap_body")(with_valid_images)
    statuses: dict[str, int] = {}
    problems: list[str] = []
    stop_reason = None
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    key = f"{interaction.request.method} {interaction.response.status_code}"
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
    stop_reason, statuses, problems = await asyncio.to_thread(run_fuzz, service.url)
    assert not problems, "\n\n".join(problems)
    assert stop_reason == StopReason.COMPLETED
    # The fuzz reached both sides of the scan endpoint: refusals and whole streams.
    assert statuses.get("POST 200", 0) > 0, statuses
    assert sum(n for key, n in statuses.items() if key.startswith("POST 4")) > 0, statuses
