"""The one way a URL is shown in a log or a message: `redact_url` (and `redact_target` for
a request's path and query, which `AccessLogScrubber` applies to uvicorn's access log:
a scan's capability token in `?token=` is a secret too). Connection URLs carry
secrets in two places — the user info (`postgresql://user:pass@db/x`) and query
parameters that asyncpg, libpq and redis-py accept (`?password=`, `?sslpassword=`) — and
both go before a URL is shown.

The user info ends at the *last* `@`, wherever it is: a password holding `@`, `/`, `?` or
`#` unescaped (which the clients themselves read in ways of their own) must not leak its
tail as a host, a path or a query. An `@` that really belongs to a query costs the log the
text before it, never a secret.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl, urlencode, urlsplit

__all__ = ["SENSITIVE_QUERY_WORDS", "AccessLogScrubber", "redact_target", "redact_url", "scrub_access_log"]

MASK = "***"
# A query parameter is masked when its name (lower case) contains one of these.
# (`pass` covers password, passwd, sslpassword; `key` covers api_key, sslkey.)
SENSITIVE_QUERY_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "sig", "credential")


def redact_url(url: str) -> str:
    """`url` without its user info and with sensitive query values masked; its fragment
    dropped. Something that is not a `scheme://` URL is masked whole."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return MASK
    had_user_info = "@" in rest
    rest = rest.rpartition("@")[2]
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError:  # an unbalanced IPv6 bracket
        return f"{scheme}://{MASK}"
    query = _masked(parts.query)
    netloc = f"{MASK}@{parts.netloc}" if had_user_info else parts.netloc
    # Joined by hand: urlunsplit drops the `//` of an empty host (`unix:///tmp/redis.sock`).
    return f"{scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def redact_target(target: str) -> str:
    """A request target (`/path?query`) with sensitive query values masked."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    return f"{path}?{_masked(query)}"


class AccessLogScrubber(logging.Filter):
    """On the `uvicorn.access` logger: its line's request target (the third argument of
    `'%s - "%s %s HTTP/%s" %d'`, uvicorn's own format) with secret query values masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_target(args[2]), *args[3:])
        return True


def scrub_access_log() -> None:
    """Install `AccessLogScrubber` on uvicorn's access logger, once per process."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessLogScrubber) for f in access.filters):
        access.addFilter(AccessLogScrubber())


def _masked(query: str) -> str:
    pairs = [(name, MASK if _sensitive(name) else value) for name, value in _query(query)]
    return urlencode(pairs, safe="*/:")


def _query(query: str) -> list[tuple[str, str]]:
    try:
        return parse_qsl(query, keep_blank_values=True, errors="strict")
    except (ValueError, UnicodeDecodeError):
        return [(MASK, MASK)] if query else []


def _sensitive(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SENSITIVE_QUERY_WORDS)
