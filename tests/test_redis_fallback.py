"""The state machine every holder of shared state uses when Redis fails
(app/runtime/redis_fallback.py), against a real Redis of the test's own that it stops,
freezes and starts again: going local once per outage, not asking Redis for a while,
coming back on the first answer; and the writes Redis missed, sent when it answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from app.runtime import redis_fallback
from app.runtime.redis_fallback import FAILED, RedisFallback, Unsent
from app.runtime.redis_link import RedisLink
from tests.conftest import eventually
from tests.redis_server import RedisServer

LOGGER = "ecoscan.test-fallback"
TIMEOUT_S = 0.2  # REDIS_TIMEOUT_S of the link under test
# Whatever the machine's load, a call to a frozen server ends well within this.
BOUNDED_S = 10.0


class Moves:
    """What a holder is told: failures counted, outages begun and ended."""

    def __init__(self) -> None:
        self.errors = 0
        self.local = 0
        self.shared = 0

    def fallback(self, link: RedisLink, *, retry_after_s: float = 0.3) -> RedisFallback:
        def error() -> None:
            self.errors += 1

        def local() -> None:
            self.local += 1

        def shared() -> None:
            self.shared += 1

        return RedisFallback(
            link,
            "test holder",
            log=logging.getLogger(LOGGER),
            local="going on alone",
            shared="shared again",
            on_error=error,
            on_local=local,
            on_shared=shared,
            retry_after_s=retry_after_s,
        )


@asynccontextmanager
async def linked(server: RedisServer) -> AsyncIterator[RedisLink]:
    link = RedisLink(server.url, prefix="fallback", timeout_s=TIMEOUT_S)
    try:
        yield link
    finally:
        await link.close()


async def test_an_outage_goes_local_once_and_the_first_answer_ends_it(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    moves = Moves()
    async with linked(own_redis) as link:
        fallback = moves.fallback(link)
        assert await fallback.call(link.client.set(link.key("k"), "v")) is True
        assert fallback.shared and fallback.asks()

        own_redis.stop()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert await fallback.call(link.client.get(link.key("k"))) is FAILED
            assert not fallback.shared
            assert await fallback.call(link.client.get(link.key("k"))) is FAILED  # the same outage
            assert (moves.errors, moves.local, moves.shared) == (2, 1, 0)

            own_redis.start()  # empty: it kept nothing on disk
            assert await eventually(fallback.asks, attempts=100, interval=0.05)  # the wait is over
            assert await fallback.call(link.client.get(link.key("k"))) is None
            assert fallback.shared
            assert (moves.errors, moves.local, moves.shared) == (2, 1, 1)
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
        assert len(said) == 2, said
        assert said[0][0] == logging.WARNING and said[0][1].startswith("test holder: Redis failed (")
        assert said[0][1].endswith("going on alone")
        assert said[1] == (logging.INFO, "test holder: Redis answers again; shared again")


async def test_after_a_failure_redis_is_not_asked_for_a_while(own_redis: RedisServer) -> None:
    moves = Moves()
    async with linked(own_redis) as link:
        fallback = moves.fallback(link, retry_after_s=3600.0)
        own_redis.stop()
        assert await fallback.call(link.client.ping()) is FAILED
        assert not fallback.asks()
        assert 3500.0 < fallback.retry_in() <= 3600.0
        # A caller that asks all the same and gets an answer ends the outage.
        own_redis.start()
        assert await fallback.call(link.client.ping()) is True
        assert fallback.asks() and fallback.retry_in() == 0.0


async def test_a_hung_redis_fails_the_call_within_its_deadline(own_redis: RedisServer) -> None:
    moves = Moves()
    async with linked(own_redis) as link:
        fallback = moves.fallback(link)
        assert await fallback.call(link.client.ping()) is True  # a pooled connection, then the hang
        own_redis.freeze()
        try:
            async with asyncio.timeout(BOUNDED_S):
                assert await fallback.call(link.client.ping()) is FAILED
        finally:
            own_redis.thaw()
        assert (moves.errors, moves.local) == (1, 1)


async def test_a_bug_in_the_call_is_not_an_outage(own_redis: RedisServer) -> None:
    moves = Moves()

    async def buggy() -> None:
        raise ValueError("ours, not Redis's")

    async with linked(own_redis) as link:
        fallback = moves.fallback(link)
        with pytest.raises(ValueError):
            await fallback.call(buggy())
        assert fallback.shared and (moves.errors, moves.local) == (0, 0)


class Written:
    """Writes through an `Unsent` into one Redis set (its sender adds a batch in one call)."""

    def __init__(self, link: RedisLink, name: str) -> None:
        self.link = link
        self.key = link.key("written")
        self.moves = Moves()
        self.unsent: Unsent[str] = Unsent(self.moves.fallback(link), self._send, name=name)

    async def _send(self, writes: list[str]) -> None:
        await self.link.client.sadd(self.key, *writes)

    async def members(self) -> set[str]:
        return {m if isinstance(m, str) else m.decode() for m in await self.link.client.smembers(self.key)}


@asynccontextmanager
async def writes(server: RedisServer, name: str = "test") -> AsyncIterator[Written]:
    async with linked(server) as link:
        written = Written(link, name)
        try:
            yield written
        finally:
            await written.unsent.aclose()


async def test_writes_redis_missed_are_sent_when_it_answers(own_redis: RedisServer) -> None:
    async with writes(own_redis) as written:
        unsent = written.unsent
        await unsent.send("before", 60.0)
        own_redis.freeze()
        try:
            for write in ("a", "b", "c"):
                unsent.later(write, 60.0)
            assert await eventually(lambda: len(unsent) == 3, attempts=200, interval=0.05)
        finally:
            own_redis.thaw()
        assert await eventually(lambda: len(unsent) == 0, attempts=200, interval=0.05)
        assert await written.members() == {"before", "a", "b", "c"}
        assert written.moves.local == written.moves.shared == 1


async def test_a_write_that_lapsed_is_forgotten_unsent(own_redis: RedisServer) -> None:
    async with writes(own_redis) as written:
        own_redis.stop()
        assert not await written.unsent.send("lapsed", 0.0)
        assert not await written.unsent.send("kept", 3600.0)
        assert sorted(written.unsent) == ["kept", "lapsed"]
        own_redis.start()
        await written.unsent.flush()
        assert len(written.unsent) == 0
        assert await written.members() == {"kept"}


async def test_aclose_sends_what_is_kept_once_more(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_fallback, "RESEND_S", 3600.0)  # only aclose sends it again
    async with writes(own_redis) as written:
        own_redis.stop()
        assert not await written.unsent.send("at exit", 3600.0)
        own_redis.start()
        assert await written.members() == set()
        await written.unsent.aclose()
        assert await written.members() == {"at exit"}


async def test_aclose_leaves_nothing_running_while_redis_is_away(own_redis: RedisServer) -> None:
    """A write that fails while closing is kept no longer: no resending starts after the
    close (it would outlive its holder)."""
    async with writes(own_redis, "closing") as written:
        own_redis.stop()
        written.unsent.later("at exit", 3600.0)  # fails during the close
        await written.unsent.aclose()
        assert written.moves.errors >= 1
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "closing-resend" and not t.done()]
