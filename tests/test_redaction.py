"""`redact_url` (app/runtime/redaction.py), the one way a URL reaches a log: no password
however it is spelled, no secret query parameter, and the rest left readable."""

from __future__ import annotations

import json
import logging

import pytest

from app.runtime.redaction import AccessLogScrubber, redact_target, redact_url
from app.runtime.redis_link import RedisLink
from app.settings import Settings
from app.sim.server import RunningSimulator
from app.upstream.deployments import DeploymentError, parse_deployments

from .conftest import running_service, settings_for


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:p@ss@db/x", "postgresql://***@db/x"),  # issue 34: `***@ss@db/x` before
        ("postgresql://u:p@s:s@db:5432/x", "postgresql://***@db:5432/x"),
        ("postgresql://u:pa/ss@db/x", "postgresql://***@db/x"),
        ("postgresql://u:pa?ss@db/x?sslmode=require", "postgresql://***@db/x?sslmode=require"),
        ("postgresql://u:pa#ss@db/x", "postgresql://***@db/x"),
        ("postgresql://u:p%40ss%3Aw%2Frd@db/x", "postgresql://***@db/x"),
        ("postgresql://user@db/x", "postgresql://***@db/x"),
        ("redis://:pw@redis:6379/0", "redis://***@redis:6379/0"),
        (
            "postgresql://db/x?password=hunter2&sslpassword=k3y&application_name=app",
            "postgresql://db/x?password=***&sslpassword=***&application_name=app",
        ),
        (
            "postgresql://db/x?PASSWD=a&pwd=b&Pass%77ord=c",
            "postgresql://db/x?PASSWD=***&pwd=***&Password=***",
        ),
        (
            "https://h/v1?token=t&api_key=k&key=k2&secret=s&x=1",
            "https://h/v1?token=***&api_key=***&key=***&secret=***&x=1",
        ),
        ("unix:///run/redis.sock?password=s3&db=0", "unix:///run/redis.sock?password=***&db=0"),
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("https://h/p#frag-with-token", "https://h/p"),
        ("host=db password=x", "***"),  # not a URL: nothing of it is shown
        ("postgresql://u:pw@[::1/x", "postgresql://***"),
    ],
)
def test_redact_url_removes_user_info_and_secret_parameters(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("password", ["p@ss", "p:ss", "p/ss", "p%40ss", "p@s:s/w?o#rd"])
def test_no_part_of_a_password_survives(password: str) -> None:
    for url in (f"postgresql://user:{password}@db:5432/x", f"redis://:{password}@r:6379/0"):
        shown = redact_url(url)
        assert not any(piece in shown for piece in ("ss", "w?o", "rd")), shown


@pytest.mark.parametrize("password", ["p@ss", "p:ss", "p/ss", "p%40ss"])
def test_a_deployments_wrong_base_url_is_named_without_its_password(password: str) -> None:
    """The message naming a base_url that is not http(s) shows it redacted (a scheme typo
    must not print the key a URL carries)."""
    entry = {
        "name": "typo",
        "provider": "compatible",
        "base_url": f"htps://user:{password}@llm.example/v1",
        "vision_model": "m",
        "answer_model": "m",
        "rpm": 1,
        "tpm": 1,
    }
    with pytest.raises(DeploymentError) as raised:
        parse_deployments(json.dumps([entry]), None)
    assert "got 'htps://***@llm.example/v1'" in str(raised.value)
    assert "ss" not in str(raised.value)


def test_secrets_are_not_in_the_settings_repr() -> None:
    settings = Settings(
        database_url="postgresql://u:dbsecret@db/x",
        redis_url="redis://:redissecret@r/0",
        openai_api_key="sk-apisecret",
        auth_mode="jwt",
        auth_jwt_secret="jwtsecret" * 4,
    )
    shown = repr(settings)
    assert not any(s in shown for s in ("dbsecret", "redissecret", "apisecret", "jwtsecret"))
    assert "redissecret" not in repr(RedisLink("redis://:redissecret@r/0", prefix="p", timeout_s=1))


async def test_the_start_up_log_shows_the_database_url_without_its_password(
    database_url: str, sim: RunningSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    """A real start against the test database with a password of `@`, `:` and `/`
    (percent-encoded: the server trusts loopback, so any password is accepted) and one more
    in the query, a form asyncpg reads too."""
    with_password = database_url.replace("://postgres@", "://postgres:p%40s%3As%2Fw@", 1)
    assert with_password != database_url
    with_password += ("&" if "?" in with_password else "?") + "sslpassword=qsecret"
    settings = settings_for(with_password, sim, log_level="INFO")
    with caplog.at_level(logging.INFO, logger="app"):
        async with running_service(settings):
            pass
    lines = [r.getMessage() for r in caplog.records if "DATABASE_URL" in r.getMessage()]
    assert lines, "no DATABASE_URL line logged"
    for line in lines:
        assert "p%40s" not in line and "qsecret" not in line and "***@" in line, line


def test_the_access_log_line_masks_scan_tokens_and_keeps_the_rest() -> None:
    assert (
        redact_target("/api/v1/scan/x/events?token=abc&after=3") == "/api/v1/scan/x/events?token=***&after=3"
    )
    assert redact_target("/api/v1/scan/x") == "/api/v1/scan/x"
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/api/v1/scan/x/events?after=0&token=abc", "1.1", 404),
        None,
    )
    assert AccessLogScrubber().filter(record)
    assert (
        record.getMessage() == '127.0.0.1:5000 - "GET /api/v1/scan/x/events?after=0&token=*** HTTP/1.1" 404'
    )


async def test_the_start_up_log_names_each_deployment_without_the_password_its_url_carries(
    database_url: str, sim: RunningSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway's base_url may carry its credentials (`https://user:key@gateway/v1`): the
    line naming each listed deployment at start shows the URL redacted."""
    with_password = sim.base_url.replace("://", "://gateway:p%40ss%3Aw0rd@", 1)
    entry = {
        "name": "gateway",
        "provider": "compatible",
        "base_url": with_password,
        "vision_model": "gpt-4o-mini",
        "answer_model": "gpt-4o-mini",
        "rpm": 10_000,
        "tpm": 10_000_000,
    }
    settings = settings_for(database_url, sim, log_level="INFO", upstreams=json.dumps([entry]))
    with caplog.at_level(logging.INFO, logger="app"):
        async with running_service(settings):
            pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("upstream gateway:")]
    assert lines, "no line names the deployment"
    for line in lines:
        assert "p%40ss" not in line and "w0rd" not in line and "***@" in line, line
