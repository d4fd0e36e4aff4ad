"""One OpenAI budget for every replica using the same key: `RateBudget` fed by leases.

Each process keeps its `RateBudget` (the FIFO, reserve-then-settle, the predictions
admission asks for); what changes is where its buckets fill from. Instead of refilling
with time, a `SharedRateBudget` holds grants leased from one token bucket per model in
Redis (shared_budget.lua, run atomically by Redis on Redis's clock):

- When the head of the local queue does not fit in what is held, the leaser asks Redis
  for what it needs plus about `LEASE_S` of this process's recent demand: one round
  trip per lease, not per call. Redis grants a need at once even when its bucket cannot
  pay it yet: the bucket goes into debt and the holder waits out the returned seconds
  before using the grant. Every later need sees the debt and waits longer, so holders
  are served in the order they asked, in one round trip each (a need with more than
  one lease of debt ahead of it, beyond its own refill time, is not granted; the holder
  asks again when it is closer). A grant for later is held from its hour on
  (`_grant_at`), so the leaser never sleeps and a 429 to announce goes out at once.
- A grant is good for `LEASE_S`. What is still held when the lease ends is returned
  (and on a clean exit). A process that dies keeps its grant: it was taken from the
  bucket and may have been spent, so it is never handed out twice; the bucket refills
  past it within a lease. Holders not heard from for three leases no longer count as
  live (a clean exit stops counting at once), so the survivors' shares grow back.
- Settling happens locally: a refund stays in what is held (and goes back with the
  rest), an extra charge is a local debt the next grant covers. A reservation taken
  before a fall back (or a recovery) refunds nothing: its bucket is gone (`epoch`).
- A 429 anywhere pauses everyone: the pause is stored with the bucket and published
  on a channel every process listens to. Reported limits (and the net rate learned
  from them) and a lower `remaining` travel with the next lease call.
- Calls sent on the key are counted in Redis (`sent`: the running sums of their
  estimates, per kind), so that what the limiter charged between two of this process's
  replies is set against every replica's calls sent in between
  (app/limits/charge_learning.py). Redis away: calls go uncounted and teach nothing.
- Redis unreachable or slow (`REDIS_TIMEOUT_S`): the process falls back to a local
  bucket at its last known share of the key (1 / the live holders Redis last counted;
  `COLD_SHARE` if it never reached Redis), logs it once and shows it in
  `ecoscan_budget_shared`. It probes every `RETRY_AFTER_FAILURE_S`; when Redis answers
  it is shared again (app/runtime/redis_fallback.py, as for every holder of shared state).

The limits this process reports (`effective_rpm`, predictions for admission) are its
share of the key's: 1 / the holders that asked for budget lately (`demand_share`: an
idle replica does not halve a busy one's predictions), and while Redis is away 1 / the
live holders (`fallback_share`: conservative).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from importlib import resources

from app.limits.charge_learning import KINDS, Sent
from app.limits.clock import Clock
from app.limits.rate_budget import RateBudget, Reservation
from app.limits.rate_headers import UpstreamSnapshot
from app.runtime.redis_fallback import REDIS_FAILURES, RedisFallback
from app.runtime.redis_link import RedisLink

__all__ = ["COLD_SHARE", "LEASE_S", "SharedRateBudget", "holder_name"]

log = logging.getLogger("ecoscan.budget")

# How long a grant may be held before what is left goes back, and how much demand
# a grant covers. Short: it bounds what a dead holder takes with it.
LEASE_S = 2.0
# The share of the key a process takes on its own when it never reached Redis.
COLD_SHARE = 0.5
# Demand is measured over at least this long (a burst of takes in a millisecond is not
# a rate of thousands per second).
DEMAND_MIN_WINDOW_S = 0.05
# A reported `remaining` older than this is not sent to Redis: it has refilled since.
REMAINING_FRESH_S = 1.0
# Pause-channel listener: each read is bounded; reconnects back off up to this.
LISTEN_POLL_S = 1.0
LISTEN_BACKOFF_MAX_S = 10.0

_SCRIPT = resources.files("app.limits").joinpath("shared_budget.lua").read_text()
# A call's estimate added to the key's running sums, which come back: in one step, so no
# other replica's call falls between the two.
_COUNT_SCRIPT = (
    "redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2]) "
    f"return redis.call('HMGET', KEYS[1], '{KINDS[0]}', '{KINDS[1]}')"
)


class _EpochReservation(Reservation):
    """A reservation that remembers the budget's epoch it was taken in."""

    __slots__ = ("epoch",)

    def __init__(self, budget: SharedRateBudget, tokens: int, epoch: int) -> None:
        super().__init__(budget, tokens)
        self.epoch = epoch

    def settle(self, actual_tokens: int | None) -> bool:
        budget = self._budget
        assert isinstance(budget, SharedRateBudget)
        return super().settle(budget._apply_epoch_refund(self, actual_tokens))


def holder_name() -> str:
    """Unique per budget: host and pid say who it is in `redis-cli`, the suffix makes it unique."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class SharedRateBudget(RateBudget):
    """`RateBudget` whose buckets are filled by leases from Redis (see module doc)."""

    # Read by `_effective` while RateBudget.__init__ runs, before our __init__ sets them.
    demand_share = 1.0  # 1 / the holders with demand: the rate predictions expect
    fallback_share = 1.0  # 1 / the live holders: the rate to fall back to without Redis
    _key_limits: tuple[int, int] | None = None

    def __init__(
        self,
        link: RedisLink,
        *,
        rpm: int,
        tpm: int,
        burst_fraction: float = 0.1,
        clock: Clock | None = None,
        name: str = "default",
        lease_s: float = LEASE_S,
        on_call: Callable[[str, float], None] | None = None,
    ) -> None:
        self._on_call = on_call or (lambda op, seconds: None)
        # Before RateBudget.__init__, whose limits ask whether the budget is shared.
        self._redis = RedisFallback(
            link,
            f"budget {name}",
            log=log,
            local=lambda: f"budgeting locally at {self.share:.0%} of the key until it answers",
            shared="the budget is shared",
            on_error=lambda: self._on_call("error", 0.0),
            on_local=self._went_local,
            on_shared=self._went_shared,
        )
        super().__init__(rpm=rpm, tpm=tpm, burst_fraction=burst_fraction, clock=clock, name=name)
        self._link = link
        self._lease_s = lease_s
        self._horizon_s = lease_s  # a need is granted ahead of time only this far
        self.holder = holder_name()
        # The bucket, its live holders, those with demand, the channel announcing 429 pauses.
        parts = ("state", "holders", "active", "pause")
        self._keys = [link.key("budget", name, part) for part in parts]
        self._sent_key = link.key("budget", name, "sent")  # every replica's calls, counted
        self._count_script = link.script(_COUNT_SCRIPT)
        self._script = link.script(_SCRIPT)
        self.demand_share = self.fallback_share = COLD_SHARE
        self._req = self._tok = 0.0  # nothing is held before the first grant
        # Granted ahead of time, usable at their hour (`_mature`): part of what the head
        # has, so it is not asked for twice. Void on a fall back.
        self._pending = (0.0, 0.0)
        # Grants held back until the debt ahead of them is paid: their timers, by a number of
        # their own (each removes its own when it fires: uvloop answers a delay under a
        # millisecond with a plain Handle, which has no when() to tell a fired one by).
        self._maturing: dict[int, asyncio.Handle] = {}
        self._grants = itertools.count()
        self._retry_at = 0.0  # a need refused as too far ahead asks again from then
        self._last_need_at = -math.inf
        # Reservations taken in one epoch (shared, fallback, shared again...) refund only
        # into the same one: a local bucket's refund is not Redis's to receive.
        self.epoch = 0
        self._lease_ends = self._clock.now()
        self._demand_since = self._clock.now()
        self._taken = (0, 0)  # requests, tokens taken since `_demand_since`
        self._pause_to_send = 0.0
        self._remaining_sent: UpstreamSnapshot | None = None
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ----- life ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._lease_loop(), name=f"budget-leaser-{self.name}"),
            asyncio.create_task(self._listen_for_pauses(), name=f"budget-pauses-{self.name}"),
        ]

    async def aclose(self) -> None:
        """Stop leasing, give back what is held, and stop counting as a holder: the
        others have both at once."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._void_pending()
        if self.shared:
            with contextlib.suppress(*REDIS_FAILURES):
                await self._lease(need=(0.0, 0.0), want=(0.0, 0.0), op="return", leaving=True)

    @property
    def shared(self) -> bool:
        """Budgeting from Redis's bucket; False while Redis fails (a local bucket)."""
        return self._redis.shared

    @property
    def share(self) -> float:
        """The share of the key this process budgets for now."""
        return self.demand_share if self.shared else self.fallback_share

    # ----- RateBudget's hooks -------------------------------------------------------------

    def _effective(self) -> tuple[int, int]:
        rpm, tpm = super()._effective()
        if self._key_limits is not None:
            rpm, tpm = min(rpm, self._key_limits[0]), min(tpm, self._key_limits[1])
        share = self.share
        return max(1, int(rpm * share)), max(1, int(tpm * share))

    def _apply_limits(self) -> None:
        held = (self._req, self._tok)
        super()._apply_limits()
        if self.shared:
            self._req, self._tok = held  # grants are held whole, an oversize one included

    def _refill(self) -> float:
        if not self.shared:
            return super()._refill()
        now = self._clock.now()  # shared: what is held grows only by grants
        self._last = now
        return now

    def _head_wait(self, tokens: int) -> float:
        wait = super()._head_wait(tokens)
        if self.shared and wait > 0.0:
            self._kick.set()  # the head needs more than is held: lease it
            return min(wait, self._lease_s)
        return wait

    def _take(self, tokens: int) -> Reservation:
        requests, taken = self._taken
        self._taken = (requests + 1, taken + tokens)
        return super()._take(tokens)

    def _reservation(self, tokens: int) -> Reservation:
        return _EpochReservation(self, tokens, self.epoch)

    def _credit(self, requests: float, tokens: float) -> None:
        if not self.shared:
            super()._credit(requests, tokens)
            return
        # Shared: what is held is not capped here (a grant may exceed this process's
        # share of the burst); Redis caps what comes back to it.
        self._req += requests
        self._tok += tokens
        self._notify_head()

    def _apply_epoch_refund(self, reservation: _EpochReservation, actual_tokens: int | None) -> int | None:
        """A reservation of an earlier epoch is settled as spent in full, a charge beyond
        it still applies: its refund belonged to a bucket that is gone."""
        if reservation.epoch == self.epoch:
            return actual_tokens
        return max(reservation.tokens, actual_tokens or 0)

    async def sent(self, kind: str, estimate: int) -> Sent:
        """Counted in Redis, with every replica's calls on the key (see module doc)."""
        if not (self.shared and self.charges.headers and self.charges.config.enabled):
            return await super().sent(kind, estimate)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._link.timeout_s):
                text, image = await self._count_script(keys=[self._sent_key], args=[kind, estimate])
        except REDIS_FAILURES:
            self._on_call("error", 0.0)
            return Sent(None, self._clock.now(), kind, estimate)  # uncounted: it teaches nothing
        self._on_call("sent", time.perf_counter() - started)
        counted = (float(text or 0), float(image or 0))
        return Sent(self.charges.next_number(), self._clock.now(), kind, estimate, counted)

    def pause(self, seconds: float) -> None:
        super().pause(seconds)
        if self.shared and seconds > 0:
            self._pause_to_send = max(self._pause_to_send, seconds)
            self._kick.set()

    # ----- leasing ------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        nothing = (0.0, 0.0)
        # Say hello: count as a live holder, learn the share before the first scan.
        await self._step(self._lease(need=nothing, want=nothing, op="heartbeat"))
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_due()):
                    await self._kick.wait()
            self._kick.clear()
            if self.shared:
                await self._step(self._serve_once())
            elif self._redis.asks():  # local: one call each RETRY_AFTER_FAILURE_S probes
                await self._step(self._lease(need=nothing, want=nothing, op="probe"))

    async def _step(self, work: Awaitable[object]) -> None:
        """One step of the leaser, and what it says of Redis (shared, local, back)."""
        try:
            await work
        except REDIS_FAILURES as exc:
            self._redis.failed(exc)
        except Exception as exc:  # a bug must not leave every reserve to its deadline
            log.exception("budget %s: leasing failed", self.name)
            self._redis.failed(exc)
        else:
            self._redis.recovered()

    def _next_due(self) -> float:
        """Seconds until the loop has work without being kicked: probing Redis, or
        giving back what is held when the lease ends."""
        if not self.shared:
            return self._redis.retry_in()
        now = self._clock.now()
        if self._need() != (0.0, 0.0) and self._retry_at > now:
            return self._retry_at - now
        if self._req > 0 or self._tok > 0:
            return max(0.0, self._lease_ends - now)
        return self._lease_s

    async def _serve_once(self) -> None:
        """One step of the leaser; it never sleeps here, so a 429 to announce is sent at
        once whatever else is pending."""
        nothing = (0.0, 0.0)
        if self._pause_to_send > 0:
            await self._lease(need=nothing, want=nothing, op="pause", give_back=False)
        need, now = self._need(), self._clock.now()
        if need != nothing and now >= self._retry_at:
            self._last_need_at = now
            granted, wait = await self._lease(need=need, want=self._want(need), op="grant")
            if granted == nothing:  # too far ahead to be granted: ask again when closer
                self._retry_at = now + min(max(wait - self._horizon_s, 0.0), self._lease_s)
            else:
                self._grant_at(granted, wait)
        elif need == nothing and now >= self._lease_ends and self._pending == nothing:
            # What is held goes back; with nothing held this is the heartbeat that keeps
            # the process counted as live (at least one call per lease).
            holding = self._req > 0 or self._tok > 0
            await self._lease(need=need, want=need, op="return" if holding else "heartbeat")
            self._lease_ends = self._clock.now() + self._lease_s

    def _grant_at(self, granted: tuple[float, float], wait: float) -> None:
        """Hold a grant now, or from when the bucket's debt ahead of it is paid."""
        if wait <= 0.0:
            self._hold(granted)
            return
        self._pending = (self._pending[0] + granted[0], self._pending[1] + granted[1])
        key = next(self._grants)
        self._maturing[key] = asyncio.get_running_loop().call_later(wait, self._mature, granted, key)

    def _mature(self, granted: tuple[float, float], key: int) -> None:
        self._maturing.pop(key, None)
        self._pending = (self._pending[0] - granted[0], self._pending[1] - granted[1])
        self._hold(granted)
        self._kick.set()  # the head may need more still

    def _void_pending(self) -> None:
        for handle in self._maturing.values():
            handle.cancel()
        self._maturing.clear()
        self._pending = (0.0, 0.0)

    def _need(self) -> tuple[float, float]:
        """What the head of the queue lacks beyond what is held and granted ahead (a
        debt left by a settle included)."""
        if not self._queue:
            return 0.0, 0.0
        tokens = self._queue[0].tokens
        requests_had, tokens_had = self._req + self._pending[0], self._tok + self._pending[1]
        return max(0.0, 1.0 - requests_had), max(0.0, tokens - tokens_had)

    def _want(self, need: tuple[float, float]) -> tuple[float, float]:
        """The need plus one lease of this process's recent demand, within its capacity."""
        now = self._clock.now()
        elapsed = max(now - self._demand_since, DEMAND_MIN_WINDOW_S)
        requests, tokens = self._taken
        self._demand_since, self._taken = now, (0, 0)
        per_lease = self._lease_s / elapsed
        want_req = min(need[0] + requests * per_lease, self._cap_req)
        want_tok = min(need[1] + tokens * per_lease, self._cap_tok)
        return max(need[0], want_req), max(need[1], want_tok)

    async def _lease(
        self,
        *,
        need: tuple[float, float],
        want: tuple[float, float],
        op: str,
        give_back: bool = True,
        leaving: bool = False,
    ) -> tuple[tuple[float, float], float]:
        """One script call: ask for `want` (at least `need`), or with no need hand back
        what is held. Returns the grant, and the seconds before it may be used (or, when
        nothing was granted, before asking again is worth it)."""
        give_back = give_back and self.shared and need == (0.0, 0.0)
        returned = (max(0.0, self._req), max(0.0, self._tok)) if give_back else (0.0, 0.0)
        # Out of what is held before the call: a reserve during the round trip must not
        # spend what is on its way back. Restored if the call fails.
        self._req -= returned[0]
        self._tok -= returned[1]
        pause, self._pause_to_send = self._pause_to_send, 0.0
        reported = RateBudget._effective(self)  # configured, lowered by reported and learned
        remaining = self._fresh_remaining()
        args = [
            self.holder,
            self._cfg_rpm,
            self._cfg_tpm,
            self._fraction,
            *need,
            *want,
            *returned,
            pause,
            reported[0] if reported[0] < self._cfg_rpm else 0,
            reported[1] if reported[1] < self._cfg_tpm else 0,
            *remaining,
            self._lease_s,
            self._horizon_s,
            1 if leaving else 0,
        ]
        started = time.perf_counter()
        try:
            async with self._redis.deadline():
                reply = await self._script(keys=self._keys, args=args)
        except BaseException:
            self._pause_to_send = max(self._pause_to_send, pause)
            self._req += returned[0]
            self._tok += returned[1]
            raise
        self._on_call(op, time.perf_counter() - started)
        granted_req, granted_tok, wait, live, rpm, tpm, paused, active = (float(x) for x in reply)
        self._update_key(live, active, rpm, tpm, paused)
        return (granted_req, granted_tok), wait

    def _hold(self, granted: tuple[float, float]) -> None:
        """Add a grant to what is held; the lease runs from now."""
        if self.shared:  # a grant that arrives after a fall back is void: the bucket is local now
            self._req += granted[0]
            self._tok += granted[1]
            self._lease_ends = self._clock.now() + self._lease_s
        self._notify_head()

    def _fresh_remaining(self) -> tuple[int, int]:
        """The latest reported `remaining` (-1: none), sent once and only while fresh."""
        snap = self.last_upstream
        if (
            snap is None
            or snap is self._remaining_sent
            or self._clock.now() - snap.observed_at > REMAINING_FRESH_S
        ):
            return -1, -1
        self._remaining_sent = snap
        requests, tokens = snap.remaining_requests, snap.remaining_tokens
        return (-1 if requests is None else requests), (-1 if tokens is None else tokens)

    def _update_key(self, live: float, active: float, rpm: float, tpm: float, paused_s: float) -> None:
        self.fallback_share = 1.0 / max(1.0, live)
        # Predictions: the rate among the holders that wanted budget lately; Redis counts
        # this one among them only once it asked with a need (so add it until then).
        counted = self._clock.now() - self._last_need_at <= 3 * self._lease_s
        self.demand_share = 1.0 / max(1.0, active if counted else active + 1.0)
        self._key_limits = (int(rpm), int(tpm))
        self._apply_limits()
        if paused_s > 0:
            super().pause(paused_s)
        self._notify_head()

    # ----- fallback (RedisFallback's moves) -----------------------------------------------

    def _went_local(self) -> None:
        self._void_pending()
        self.epoch += 1
        self._last = self._clock.now()  # the local bucket refills from now, not retroactively
        self._apply_limits()
        self._notify_head()

    def _went_shared(self) -> None:
        # What the local bucket refilled was never granted: drop it, keep a debt. The probe
        # returned nothing (it only counted what was positive).
        self.epoch += 1
        self._req, self._tok = min(self._req, 0.0), min(self._tok, 0.0)
        self._apply_limits()
        self._notify_head()

    # ----- pauses from other processes ----------------------------------------------------

    async def _listen_for_pauses(self) -> None:
        backoff = LISTEN_POLL_S
        while True:
            try:
                await self._listen_once()
                backoff = LISTEN_POLL_S
            except REDIS_FAILURES:
                pass
            except Exception:  # a bug must not end the listening for good
                log.exception("budget %s: listening for pauses failed", self.name)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, LISTEN_BACKOFF_MAX_S)

    async def _listen_once(self) -> None:
        pubsub = self._link.client.pubsub(ignore_subscribe_messages=True)
        try:
            async with self._redis.deadline():
                await pubsub.subscribe(self._keys[3])
            while True:
                message = await pubsub.get_message(timeout=LISTEN_POLL_S)
                if message is not None and message.get("type") == "message":
                    seconds = float(message["data"])
                    if math.isfinite(seconds) and seconds > 0:
                        RateBudget.pause(self, seconds)  # not ours to send on again
        finally:
            with contextlib.suppress(*REDIS_FAILURES):
                async with self._redis.deadline():
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
