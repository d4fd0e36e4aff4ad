"""`ChatEndpoint` builds its request from settings: the URL under the base URL, the key as
a bearer token, a JSON body, and the proxy the environment names, read once."""

from __future__ import annotations

import pytest
import yarl

from app.upstream.endpoint import ChatEndpoint, env_proxy


async def test_the_request_is_built_from_the_base_url_and_the_key() -> None:
    for base_url in ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100/v1/"):
        chat = ChatEndpoint.open(
            base_url, "sk-x", connect_timeout_s=2, read_timeout_s=7, max_connections=4, keepalive_s=5
        )
        try:
            assert chat.url == "http://127.0.0.1:8100/v1/chat/completions"
            headers = chat.session.headers
            assert headers["Authorization"] == "Bearer sk-x"
            assert headers["Content-Type"] == "application/json"
            timeout = chat.session.timeout
            assert (timeout.sock_connect, timeout.connect, timeout.sock_read) == (2, 2, 7)
            assert chat.read_timeout_s == 7
        finally:
            await chat.aclose()


async def test_an_empty_key_sends_no_authorization() -> None:
    chat = ChatEndpoint.open(
        "http://x/v1", "", connect_timeout_s=1, read_timeout_s=1, max_connections=1, keepalive_s=1
    )
    try:
        assert "Authorization" not in chat.session.headers
    finally:
        await chat.aclose()


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
