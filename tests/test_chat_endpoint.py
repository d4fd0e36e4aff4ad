"""`ChatEndpoint` builds its request from settings: the provider's URL under the base URL
and its auth header (app/upstream/providers/), a JSON body, and the proxy the environment
names, read once."""

from __future__ import annotations

import pytest
import yarl

from app.upstream.deployments import Deployment
from app.upstream.endpoint import ChatEndpoint, env_proxy
from app.upstream.providers import PROVIDERS


def deployment(
    provider: str, base_url: str, key: str | None = "sk-x", api_version: str | None = None
) -> Deployment:
    return Deployment(
        "d", provider, base_url, 1, 1, api_key_env="K", answer_model="m", api_key=key, api_version=api_version
    )


async def open_for(d: Deployment, model: str = "m") -> ChatEndpoint:
    provider = PROVIDERS[d.provider]
    return ChatEndpoint.open(
        provider.chat_url(d, model),
        provider.credential(d),
        connect_timeout_s=2,
        read_timeout_s=7,
        max_connections=4,
        keepalive_s=5,
    )


async def test_the_request_is_built_from_the_base_url_and_the_key() -> None:
    for base_url in ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/v1/"):
        chat = await open_for(deployment("openai", base_url))
        try:
            assert chat.url == "http://127.0.0.1:8100/v1/chat/completions"
            headers = chat.session.headers
            assert headers["Authorization"] == "Bearer sk-x"
            assert headers["Content-Type"] == "application/json"
            timeout = chat.session.timeout
            assert (timeout.sock_connect, timeout.connect) == (2, 2)
            # The waits for the reply are ours (Upstream._reply, watch_stream), not aiohttp's.
            assert (timeout.sock_read, timeout.total) == (None, None)
            assert chat.read_timeout_s == 7
        finally:
            await chat.aclose()


async def test_an_empty_key_sends_no_authorization() -> None:
    chat = await open_for(deployment("compatible", "http://x/v1", key=None))
    try:
        assert "Authorization" not in chat.session.headers
    finally:
        await chat.aclose()


async def test_azure_takes_its_key_in_api_key_and_the_classic_layout_names_the_deployment() -> None:
    v1 = await open_for(deployment("azure", "https://eco.openai.azure.com/openai/v1/"))
    classic = await open_for(
        deployment("azure", "https://eco.openai.azure.com/", api_version="2024-10-21"), "gpt4o-mini-eu"
    )
    try:
        assert v1.url == "https://eco.openai.azure.com/openai/v1/chat/completions"
        assert v1.session.headers["api-key"] == "sk-x" and "Authorization" not in v1.session.headers
        assert classic.url == (
            "https://eco.openai.azure.com/openai/deployments/gpt4o-mini-eu/chat/completions?api-version=2024-10-21"
        )
    finally:
        await v1.aclose()
        await classic.aclose()


def test_the_proxy_comes_from_the_environment_with_its_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert env_proxy("https://api.openai.com/v1/chat/completions") == (None, None)
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@proxy.internal:3128")
    proxy, auth = env_proxy("https://api.openai.com/v1/chat/completions")
    assert proxy == yarl.URL("http://proxy.internal:3128")
    assert auth is not None and (auth.login, auth.password) == ("user", "pw")
    assert env_proxy("http://127.0.0.1:8100/v1/chat/completions") == (None, None)  # no HTTP_PROXY
    monkeypatch.setenv("NO_PROXY", "api.openai.com")
    assert env_proxy("https://api.openai.com/v1/chat/completions") == (None, None)
