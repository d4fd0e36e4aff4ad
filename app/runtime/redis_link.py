"""The process's one connection to Redis, when `REDIS_URL` is set.

Replicas share through it the rate budget (app/limits/shared_budget.py), the per-user
caps (app/limits/shared_user_caps.py), rate and quota (app/limits/user_quota.py), the
breakers (app/upstream/shared_breaker.py) and the events of running scans
(app/scans/mirror.py). Every key lives under `REDIS_PREFIX`, so several deployments can
share one server.

Every command is bounded by `REDIS_TIMEOUT_S` (connect and read). Redis is never a
reason to stop serving: each user of the link goes on with a local state when a call
fails (the shared ones through app/runtime/redis_fallback.py), and says so in its
metrics and in one log line per outage, not per call.

A restarted Redis leaves every pooled connection dead. So that the first command after
the return does not fail (and send its caller to its fallback, where per-user caps count
one replica only), a connection is checked when taken from the pool and a command that
still meets a closed connection is sent once more on a fresh one (`connection_options`).
Only a connection error is retried, never a timeout: a hung Redis must not double its
wait. A command whose connection broke after Redis ran it may run twice; every command
we send is safe to repeat (slot members and stream ids are unique, a lease granted
twice is only a lease the holder never uses).
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from app.runtime.redaction import redact_url

__all__ = ["RedisError", "RedisLink", "connection_options"]

log = logging.getLogger("ecoscan.redis")

# Connections kept open to Redis for short commands (leases, caps, stream writes); followers'
# blocking XREADs have a client of their own (app/scans/mirror.py).
MAX_CONNECTIONS = 64


class RedisLink:
    """A redis.asyncio client, the key prefix, and the timeout every call gets."""

    def __init__(self, url: str, *, prefix: str, timeout_s: float) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        # A full pool makes a caller wait (at most `timeout_s`) for a connection rather than
        # fail at once: a burst of admissions is not a Redis outage.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            **connection_options(timeout_s),
        )
        self.client: redis.Redis = redis.Redis.from_pool(pool)

    def key(self, *parts: str) -> str:
        """`<prefix>:<part>:<part>...`: every key this process touches is named here."""
        return ":".join((self.prefix, *parts))

    def script(self, source: str) -> Any:
        """A Lua script run by EVALSHA (loaded on first use, reloaded after a flush)."""
        return self.client.register_script(source)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.client.aclose()

    def __repr__(self) -> str:
        return f"RedisLink({redact_url(self.url)!r}, prefix={self.prefix!r})"


def connection_options(timeout_s: float) -> dict[str, Any]:
    """What every client of ours passes its pool: the retry after a restart, and no
    maintenance notifications.

    redis-py's default ("auto") skips the pool's check of a connection the server closed
    (so a restart is met by a command, not by the check), asks every new connection for
    notifications with one more round trip, and would relax timeouts to 10 s during a
    maintenance: none of which a service bounded by `REDIS_TIMEOUT_S` wants.
    """
    return {
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
    }
