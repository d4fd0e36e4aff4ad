"""Deployments that prove who calls with a short-lived token, fetched by the provider's own
library from a local token service (app/sim/issuer.py), sent to simulators that accept
only its tokens and only until they expire: Azure with Microsoft Entra ID (azure-identity,
through the managed identity endpoint as App Service serves it), Gemini on Vertex AI
(google-auth, a service account whose key file's `token_uri` is the local service).
Real service, real PostgreSQL, real HTTP throughout."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import app.upstream.client
import app.upstream.probes
from app.sim.config import SimConfig
from app.sim.issuer import RunningIssuer, run_token_issuer
from app.sim.server import RunningSimulator, run_simulator

from .conftest import ScanOutcome, Service, data_url, eventually, make_jpeg, run_scan, sim_stats
from .test_routing import routed_service

SECRET = "issuer-and-simulators-share-this"
# Tokens live this long: several roll over while a test's scans run.
TOKEN_LIFE_S = 6.0
LOAD_S = 15.0
FAST: dict[str, Any] = {"time_scale": 0.002, "latency_sigma": 0.0, "text_tokens": 40, "rpm": 0, "tpm": 0}


def retry_probes_after(monkeypatch: pytest.MonkeyPatch, name: str, seconds: float) -> None:
    """A retry constant of app/upstream/breaker.py set to `seconds` where it is used (each
    module imported its own name)."""
    monkeypatch.setattr(app.upstream.client, name, seconds)
    monkeypatch.setattr(app.upstream.probes, name, seconds)


def token_sim(flavor: str) -> SimConfig:
    return SimConfig(flavor=flavor, auth="token", token_secret=SECRET, **FAST)


def entra_id(issuer: RunningIssuer, monkeypatch: pytest.MonkeyPatch) -> None:
    """azure-identity's managed identity, as App Service provides it, from the local service."""
    for name in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", issuer.azure_endpoint)
    monkeypatch.setenv("IDENTITY_HEADER", issuer.issuer.identity_header)


def google_service_account(issuer: RunningIssuer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Application Default Credentials: a service account key file whose `token_uri` is
    the local service."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "ecoscan-test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "scanner@ecoscan-test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": issuer.google_token_uri,
    }
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps(info))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))


def listed(name: str, provider: str, auth: str, base_url: str, model: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "provider": provider,
        "auth": auth,
        "base_url": base_url,
        "vision_model": model,
        "answer_model": model,
        "rpm": 60_000,
        "tpm": 100_000_000,
        **more,
    }


def vertex_before_an_api_key(vertex: RunningSimulator, gemini: RunningSimulator) -> list[dict[str, Any]]:
    """Gemini on Vertex AI first, and Gemini's API with a key to take its calls while it is out."""
    base_url = f"{vertex.url}/v1/projects/ecoscan-test/locations/europe-west4/endpoints/openapi"
    return [
        listed("vertex", "gemini", "vertex_ai", base_url, "google/gemini-2.5-flash"),
        listed(
            "gemini-api",
            "gemini",
            "key",
            f"{gemini.url}/v1beta/openai/",
            "gemini-2.5-flash",
            api_key_env="KEY_GEMINI_API",
            priority=1,
        ),
    ]


async def scans_for(svc: Service, seconds: float, workers: int = 6) -> list[ScanOutcome]:
    """Scans back to back from `workers` users for `seconds`, each of a photo of its own."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + seconds
    outcomes: list[ScanOutcome] = []

    async def user(number: int) -> None:
        seed = number * 100_000
        while loop.time() < ends:
            seed += 1
            image = data_url(make_jpeg(seed, (96, 64)))
            headers = {"X-User-ID": f"u{number}"}
            outcomes.append(await run_scan(svc.client, json={"image_url": image}, headers=headers))

    await asyncio.gather(*(user(n) for n in range(workers)))
    return outcomes


def failed(outcomes: list[ScanOutcome]) -> list[Any]:
    return [
        o.terminal.data if o.status == 200 else o.body
        for o in outcomes
        if o.status != 200 or o.terminal.event != "done"
    ]


async def test_entra_id_tokens_roll_over_under_load_with_no_failed_scan(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with run_token_issuer(SECRET, TOKEN_LIFE_S) as issuer, run_simulator(token_sim("azure")) as az:
        entra_id(issuer, monkeypatch)
        deployment = listed("azure-entra", "azure", "entra_id", f"{az.url}/openai/v1/", "gpt-4o-mini")
        async with routed_service(database_url, sim, monkeypatch, [deployment]) as svc:
            outcomes = await scans_for(svc, LOAD_S)
            stats = await sim_stats(az)
    assert outcomes and failed(outcomes) == []
    assert len(outcomes) >= 30, len(outcomes)  # under load: many scans at every rollover
    # A token lives 6 s: over 15 s the service fetched new ones ahead of their end...
    assert issuer.issuer.issued >= 3, issuer.issuer.issued
    # ...and the strict simulator refused none (an expired token would be a 401).
    assert set(stats["by_status"]) == {"200"}, stats["by_status"]


async def test_vertex_ai_tokens_roll_over_under_load_with_no_failed_scan(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async with run_token_issuer(SECRET, TOKEN_LIFE_S) as issuer, run_simulator(token_sim("gemini")) as gem:
        google_service_account(issuer, tmp_path, monkeypatch)
        base_url = f"{gem.url}/v1/projects/ecoscan-test/locations/europe-west4/endpoints/openapi"
        deployment = listed("vertex", "gemini", "vertex_ai", base_url, "google/gemini-2.5-flash")
        async with routed_service(database_url, sim, monkeypatch, [deployment]) as svc:
            outcomes = await scans_for(svc, LOAD_S)
            stats = await sim_stats(gem)
    assert outcomes and failed(outcomes) == []
    assert len(outcomes) >= 30, len(outcomes)
    assert issuer.issuer.issued >= 3, issuer.issuer.issued
    assert set(stats["by_status"]) == {"200"}, stats["by_status"]


async def test_the_simulator_refuses_an_expired_token_as_the_provider_does() -> None:
    """What the tests above rely on: a token past its end is a 401 in the provider's words."""
    import aiohttp

    from app.sim.issuer import mint

    async with run_simulator(token_sim("gemini")) as gem, run_simulator(token_sim("azure")) as az:
        body = {"model": "gemini-2.5-flash", "messages": [{"role": "user", "content": "hi"}]}
        vertex = f"{gem.url}/v1/projects/p/locations/us-central1/endpoints/openapi/chat/completions"
        azure = f"{az.url}/openai/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            for url in (vertex, azure):
                for token, status in ((mint(SECRET, 1.0), 401), (mint("another", 9e9), 401)):
                    async with http.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
                        assert r.status == status, (url, await r.text())
            async with http.post(
                vertex, json=body, headers={"Authorization": "Bearer " + mint(SECRET, 1.0)}
            ) as r:
                assert "ACCESS_TOKEN_EXPIRED" in await r.text()
            async with http.post(azure, json=body, headers={"api-key": "k"}) as r:
                assert r.status == 403 and "AuthenticationTypeDisabled" in await r.text()  # keys disabled
            good = mint(SECRET, 9e9)
            async with http.post(vertex, json=body, headers={"Authorization": f"Bearer {good}"}) as r:
                assert r.status == 200, await r.text()


async def test_a_failed_refresh_takes_the_deployment_out_and_scans_go_to_another(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Probed again after half a second instead of CREDENTIAL_RETRY_S, to see it come back.
    retry_probes_after(monkeypatch, "CREDENTIAL_RETRY_S", 0.5)
    keyed = SimConfig(flavor="azure", api_key="sk-standby", **FAST)
    async with (
        run_token_issuer(SECRET, 3600) as issuer,
        run_simulator(token_sim("azure")) as primary,
        run_simulator(keyed) as standby,
    ):
        entra_id(issuer, monkeypatch)
        issuer.issuer.fail_status = 400  # the token service refuses
        deployments = [
            listed("entra", "azure", "entra_id", f"{primary.url}/openai/v1/", "gpt-4o-mini"),
            listed(
                "standby",
                "azure",
                "key",
                f"{standby.url}/openai/v1/",
                "gpt-4o-mini",
                api_key_env="KEY_STANDBY",
                priority=1,
            ),
        ]
        async with routed_service(database_url, sim, monkeypatch, deployments) as svc:
            during = await scans_for(svc, 1.0, workers=2)
            assert during and failed(during) == []
            assert {o.terminal.data["upstreams"]["answer"] for o in during} == {"standby"}
            assert (await sim_stats(primary))["requests_total"] == 0  # nothing went without a token
            ready = (await svc.client.get("/readyz")).json()
            # Out, or already probed again (every half second here): for want of a token.
            assert re.fullmatch(
                r"(out for \d+ s more|probing) \(no credential\)", ready["checks"]["upstreams"]["entra"]
            )
            issuer.issuer.fail_status = 0  # back: its probe gets a token and closes it
            back = {"upstream": "entra", "outcome": "ok"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", back) >= 1, attempts=500
            )
            after = await scans_for(svc, 0.5, workers=2)
    assert failed(after) == []
    assert "entra" in {o.terminal.data["upstreams"]["answer"] for o in after}


async def test_a_token_service_that_is_down_takes_vertex_out_and_scans_go_to_the_api_key(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    retry_probes_after(monkeypatch, "CREDENTIAL_RETRY_S", 0.5)
    keyed = SimConfig(flavor="gemini", api_key="sk-gemini-api", **FAST)
    async with (
        run_token_issuer(SECRET, 3600) as issuer,
        run_simulator(token_sim("gemini")) as vertex,
        run_simulator(keyed) as gemini,
    ):
        google_service_account(issuer, tmp_path, monkeypatch)
        issuer.listener.stop()  # nobody listens: every token request is refused a connection
        deployments = vertex_before_an_api_key(vertex, gemini)
        async with routed_service(database_url, sim, monkeypatch, deployments) as svc:
            during = await scans_for(svc, 1.0, workers=2)
            ready = (await svc.client.get("/readyz")).json()
            assert re.fullmatch(
                r"(out for \d+ s more|probing) \(no credential\)", ready["checks"]["upstreams"]["vertex"]
            )
            await issuer.listener.resume()
            back = {"upstream": "vertex", "outcome": "ok"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", back) >= 1, attempts=1000
            )
            after = await scans_for(svc, 0.5, workers=2)
            vertex_calls = (await sim_stats(vertex))["requests_total"]
    assert during and failed(during) == []
    assert {o.terminal.data["upstreams"]["answer"] for o in during} == {"gemini-api"}
    assert failed(after) == [] and vertex_calls > 0
    assert "vertex" in {o.terminal.data["upstreams"]["answer"] for o in after}


async def test_a_token_refused_at_the_probe_is_not_sent_again_by_the_next_probe(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The token service issues tokens the provider does not take (another audience, a
    skewed clock), then mends. Each probe's 401 drops the token it sent, so a probe after
    the mend fetches one that works; were the refused token kept, every probe would resend
    it until its planned refresh (an hour-long token: most of an hour out). Vertex AI:
    google-auth fetches anew when asked (azure-identity hands back its cached token until
    its own refresh, so an Entra ID deployment waits for that; docs/configuration.md)."""
    retry_probes_after(monkeypatch, "OUT_RETRY_S", 0.5)
    keyed = SimConfig(flavor="gemini", api_key="sk-gemini-api", **FAST)
    async with (
        run_token_issuer("not-the-providers-secret", 3600) as issuer,
        run_simulator(token_sim("gemini")) as vertex,
        run_simulator(keyed) as gemini,
    ):
        google_service_account(issuer, tmp_path, monkeypatch)
        deployments = vertex_before_an_api_key(vertex, gemini)
        async with routed_service(database_url, sim, monkeypatch, deployments) as svc:
            during = await scans_for(svc, 0.5, workers=2)
            refused_probe = {"upstream": "vertex", "outcome": "failed"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", refused_probe) >= 1, attempts=1000
            )
            issuer.issuer.secret = SECRET  # mended: its tokens are the provider's now
            back = {"upstream": "vertex", "outcome": "ok"}
            assert await eventually(
                lambda: svc.metric("ecoscan_upstream_probes_total", back) >= 1, attempts=1000
            )
            after = await scans_for(svc, 0.5, workers=2)
    assert during and failed(during) == [] and failed(after) == []
    assert "vertex" in {o.terminal.data["upstreams"]["answer"] for o in after}
