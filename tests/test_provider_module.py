"""Adding a provider is one file in app/upstream/providers/: a module dropped into the
package (here into a folder added to its path, so the source tree is left alone) is found
by listing it, and deployments name it at once. This one signs every request itself and
bills images its own way; a scan runs through it against a simulator that checks each
signature."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import time
from pathlib import Path

import pytest

import app.upstream.providers as providers
from app.sim.config import SimConfig
from app.sim.issuer import token_left
from app.sim.server import RunningSimulator, run_simulator

from .conftest import data_url, make_jpeg, run_scan, sim_stats
from .test_routing import routed_service

SECRET = "acme-shared-secret"
FLAT_IMAGE_TOKENS = 50_000

MODULE = '''
"""Acme: OpenAI's wire; every request signed with the shared secret (a signature that
holds a minute); an image is billed a flat number of tokens."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping

from app.upstream.credentials import Credential
from app.upstream.providers import register
from app.upstream.providers.base import Provider

SIGNED = "signed"


class Signature(Credential):
    per_request = True

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.signed = 0

    async def headers(self, url: str, body: bytes) -> Mapping[str, str]:
        ends = str(int((time.time() + 60) * 1000))
        mac = hmac.new(self.secret.encode(), ends.encode(), hashlib.sha256).hexdigest()[:32]
        self.signed += 1
        return {"Authorization": f"Bearer sim.{ends}.{mac}"}


class FlatImages:
    def tokens(self, width: int | None, height: int | None, detail: str = "auto") -> int:
        return FLAT


FLAT = 50_000
SIGNATURES: list[Signature] = []


class Acme(Provider):
    name = "acme"
    auths = (SIGNED,)

    def credential(self, deployment):
        signature = Signature(os.environ["ACME_SECRET"])
        SIGNATURES.append(signature)
        return signature

    def image_billing(self, model: str) -> FlatImages:
        return FlatImages()


register(Acme())
'''


@pytest.fixture
def acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    (tmp_path / "acme.py").write_text(MODULE)
    monkeypatch.setattr(providers, "__path__", [*providers.__path__, str(tmp_path)])
    monkeypatch.setenv("ACME_SECRET", SECRET)
    try:
        providers.discover()
        yield sys.modules["app.upstream.providers.acme"]
    finally:
        providers.PROVIDERS.pop("acme", None)
        sys.modules.pop("app.upstream.providers.acme", None)


def test_the_simulator_takes_the_signature_the_module_makes() -> None:
    ends = str(int((time.time() + 60) * 1000))
    mac = hmac.new(SECRET.encode(), ends.encode(), hashlib.sha256).hexdigest()[:32]
    left = token_left(f"sim.{ends}.{mac}", SECRET)
    assert left is not None and 50 < left <= 60


async def test_a_provider_module_dropped_into_the_package_serves_scans(
    acme: object, database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "acme" in providers.PROVIDERS
    checking = SimConfig(
        auth="token", token_secret=SECRET, time_scale=0.002, latency_sigma=0.0, text_tokens=40, rpm=0, tpm=0
    )
    async with run_simulator(checking) as upstream:
        deployment = {
            "name": "acme-1",
            "provider": "acme",
            "auth": "signed",
            "base_url": upstream.base_url,
            "vision_model": "gpt-4.1-mini",
            "answer_model": "gpt-4.1-mini",
            "rpm": 6000,
            "tpm": 100_000_000,
        }
        async with routed_service(database_url, sim, monkeypatch, [deployment]) as svc:
            outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(7, (96, 64)))})
            estimated = svc.metric(
                "ecoscan_upstream_tokens_total", {"model": "gpt-4.1-mini", "kind": "estimated"}
            )
            stats = await sim_stats(upstream)
    assert outcome.terminal.event == "done", json.dumps(outcome.terminal.data)
    assert outcome.terminal.data["upstreams"] == {"vision": "acme-1", "answer": "acme-1"}
    # Each call carried a signature the simulator checked (a wrong one is a 401).
    assert set(stats["by_status"]) == {"200"} and stats["requests_total"] == 2
    assert sum(s.signed for s in acme.SIGNATURES) == 2  # type: ignore[attr-defined]
    # The vision call's image was reserved as the module bills it: gpt-4.1-mini's own rule
    # (32-px patches) would have been a few dozen tokens.
    assert estimated >= FLAT_IMAGE_TOKENS
