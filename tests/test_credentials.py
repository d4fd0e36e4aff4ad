"""A credential that expires (app/upstream/credentials.py): refreshed ahead of its end, one
refresh at a time, waits bounded; and the `auth` a deployment names, checked by its
provider."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from app.upstream.credentials import CredentialUnavailable, RefreshingToken, Token
from app.upstream.deployments import DeploymentError, parse_deployments


class Wall:
    """The wall clock tokens are dated by, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Service:
    """A token service: each fetch a new token living `life_s`, after `delay_s`; `fail`:
    the next fetches raise."""

    def __init__(self, wall: Wall, life_s: float = 3600.0, delay_s: float = 0.0) -> None:
        self.wall = wall
        self.life_s = life_s
        self.delay_s = delay_s
        self.fetches = 0
        self.fail = False

    async def fetch(self) -> Token:
        self.fetches += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise OSError("token service down")
        return Token(f"t{self.fetches}", self.wall.now + self.life_s)


def token(service: Service, wall: Wall, **options: Any) -> RefreshingToken:
    return RefreshingToken("d", service.fetch, clock=wall, **options)


async def sent(credential: RefreshingToken) -> str:
    return (await credential.headers("http://x/chat/completions", b"{}"))["Authorization"]


async def test_many_first_requests_share_one_fetch() -> None:
    wall = Wall()
    service = Service(wall, delay_s=0.05)
    credential = token(service, wall)
    got = await asyncio.gather(*(sent(credential) for _ in range(50)))
    assert set(got) == {"Bearer t1"} and service.fetches == 1
    assert await sent(credential) == "Bearer t1" and service.fetches == 1  # from memory


async def test_a_token_is_refreshed_ahead_of_its_end_while_requests_go_on_with_it() -> None:
    wall = Wall()
    service = Service(wall, delay_s=0.05)
    credential = token(service, wall, refresh_ahead_s=300, min_left_s=30)
    assert await sent(credential) == "Bearer t1"
    wall.now += 3600 - 299  # within the refresh margin, well before the end
    # Nobody waits for the refresh: all are answered at once with the token they have.
    got = await asyncio.wait_for(asyncio.gather(*(sent(credential) for _ in range(20))), 0.04)
    assert set(got) == {"Bearer t1"}
    await asyncio.sleep(0.1)  # the one refresh lands
    assert service.fetches == 2 and await sent(credential) == "Bearer t2"


async def test_a_token_too_close_to_its_end_is_not_sent_the_request_waits_for_the_next() -> None:
    wall = Wall()
    service = Service(wall, delay_s=0.05)
    credential = token(service, wall, refresh_ahead_s=300, min_left_s=30)
    await sent(credential)
    wall.now += 3600 - 20  # 20 s left: less than the request may need
    assert set(await asyncio.gather(*(sent(credential) for _ in range(20)))) == {"Bearer t2"}
    assert service.fetches == 2


async def test_a_short_lived_token_is_refreshed_at_half_its_life() -> None:
    wall = Wall()
    service = Service(wall, life_s=8.0)
    credential = token(service, wall)  # the defaults: 300 s ahead, 30 s left
    await sent(credential)
    wall.now += 3.9
    await sent(credential)
    await asyncio.sleep(0)
    assert service.fetches == 1
    wall.now += 0.2  # past half its life
    assert await sent(credential) == "Bearer t1"  # still valid: sent while the next comes
    await asyncio.sleep(0.01)
    assert service.fetches == 2 and await sent(credential) == "Bearer t2"


async def test_the_wait_for_a_token_is_bounded() -> None:
    wall = Wall()
    service = Service(wall, delay_s=30.0)  # a token service that does not answer
    credential = token(service, wall, max_wait_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(CredentialUnavailable, match="no token within"):
        await sent(credential)
    assert loop.time() - started < 1.0
    await credential.aclose()


async def test_a_failed_refresh_ahead_keeps_the_token_until_it_is_too_old() -> None:
    wall = Wall()
    service = Service(wall)
    credential = token(service, wall, refresh_ahead_s=300, min_left_s=30, retry_s=5)
    await sent(credential)
    service.fail = True
    wall.now += 3600 - 200
    assert await sent(credential) == "Bearer t1"
    await asyncio.sleep(0.01)
    assert service.fetches == 2
    assert await sent(credential) == "Bearer t1"  # tried again only after retry_s
    await asyncio.sleep(0.01)
    assert service.fetches == 2
    wall.now += 6
    await sent(credential)
    await asyncio.sleep(0.01)
    assert service.fetches == 3
    wall.now += 200 - 6 - 20  # 20 s left: no longer sent, and no new one to be had
    with pytest.raises(CredentialUnavailable, match="no usable token"):
        await sent(credential)
    service.fail = False  # the service is back: the next request gets a token
    assert await sent(credential) == "Bearer t5"


async def test_a_refused_token_is_not_sent_again() -> None:
    wall = Wall()
    service = Service(wall)
    credential = token(service, wall)
    refused = await credential.headers("http://x/chat/completions", b"{}")
    credential.refused(refused)  # the provider answered 401 to it
    assert await sent(credential) == "Bearer t2"


class CachingService(Service):
    """A token service behind a library that caches (azure-identity does): the token it
    holds until the test rotates it, however often it is asked."""

    def __init__(self, wall: Wall) -> None:
        super().__init__(wall)
        self.held: Token | None = None

    async def fetch(self) -> Token:
        if self.held is None:
            self.held = await super().fetch()
        return self.held

    def rotate(self) -> None:
        self.held = None


async def test_a_late_401_to_a_token_already_replaced_keeps_its_successor() -> None:
    """Two requests carried t1 and both are refused; the first 401 brings t2. The second
    401 speaks of t1 only: forgetting t2 for it asks the library again, which hands back
    t2 (cached), taken as no new token: the deployment would go out with a valid token."""
    wall = Wall()
    service = CachingService(wall)
    credential = token(service, wall)
    first = await credential.headers("http://x/chat/completions", b"{}")
    service.rotate()  # t1 revoked: the service now hands out t2
    credential.refused(first)  # request A's 401
    assert await sent(credential) == "Bearer t2"
    credential.refused(first)  # request B's 401, also to t1, arrives later
    assert await sent(credential) == "Bearer t2"
    assert service.fetches == 2


def parsed(entry: dict[str, Any]) -> None:
    base = {"name": "d", "base_url": "https://r.example/openai/v1", "rpm": 1, "tpm": 1, "answer_model": "m"}
    full = {**base, "vision_model": "m", **entry}
    parse_deployments(json.dumps([full]), None)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"provider": "openai", "auth": "entra_id"}, "auth: one of key for provider 'openai'"),
        ({"provider": "azure", "auth": "vertex_ai"}, "auth: one of key, entra_id for provider 'azure'"),
        (
            {"provider": "azure", "auth": "entra_id", "api_key_env": "K"},
            "api_key_env: not used with auth 'entra_id'",
        ),
        ({"provider": "azure"}, "api_key_env: required for provider 'azure'"),
    ],
)
def test_each_provider_checks_the_auth_it_takes(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(DeploymentError, match=f"deployment 'd': {message}"):
        parsed(entry)


def test_a_token_deployment_names_no_key() -> None:
    parsed({"provider": "azure", "auth": "entra_id"})
    parsed({"provider": "gemini", "auth": "vertex_ai"})


def test_a_vertex_model_name_is_its_models_profile_and_price() -> None:
    """Vertex AI names Gemini `google/gemini-2.5-flash`: the publisher aside, the same model."""
    from app.upstream.prices import DEFAULT_PRICES, price_of
    from app.upstream.profiles import DEFAULT_PROFILE, profile_for

    assert profile_for("google/gemini-2.5-flash") == profile_for("gemini-2.5-flash") != DEFAULT_PROFILE
    assert price_of("google/gemini-2.5-flash", DEFAULT_PRICES) == DEFAULT_PRICES["gemini-2.5-flash"]
    assert price_of("google/unknown-model", DEFAULT_PRICES) is None


async def test_a_token_and_its_credential_keep_the_secret_out_of_their_repr() -> None:
    """A Token or a RefreshingToken in a log line, an error or a traceback's locals must
    not print the bearer secret."""
    wall = Wall()
    service = Service(wall)
    credential = token(service, wall)
    await sent(credential)
    assert "t1" not in repr(Token("t1", wall.now + 60.0))
    assert "t1" not in repr(credential) and "t1" not in repr(vars(credential).get("_token"))


@pytest.mark.parametrize(
    ("provider", "auth", "package", "extra"),
    [("azure", "entra_id", "azure", "azure"), ("gemini", "vertex_ai", "google", "google")],
)
def test_a_token_auth_without_its_library_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, provider: str, auth: str, package: str, extra: str
) -> None:
    """The Docker image has neither extra: without the library's top-level package at all,
    looking for it raised ModuleNotFoundError (a traceback at start) instead of saying
    which extra to install. None in sys.modules is Python's own "not importable"."""
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(DeploymentError, match=rf"needs .*pip install 'ecoscan\[{extra}\]'"):
        parsed({"provider": provider, "auth": auth})
