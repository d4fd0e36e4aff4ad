"""Group commit (app/db/batch.py): the writes of many scans go out as one statement when
the process is busy, alone when it is not, and each caller still gets its own result."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import asyncpg

from app.db.batch import GroupCommit
from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool, database_error, row_error
from app.errors import DatabaseError, ProcessLost
from app.scans.store import ScanStore, TerminalRow
from app.stages.reward import RewardStage


class Statements:
    """A writer that records each statement's rows; `hold` keeps statements in progress."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.fail = False

    async def write(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await self.hold.wait()
        if self.fail:
            raise DatabaseError() from OSError("the server went away")
        return [item * 10 for item in items]


async def test_alone_at_a_light_load_together_when_busy_each_with_its_own_result() -> None:
    statements = Statements()
    commit = GroupCommit(statements.write, error=database_error, flushes=2, max_batch=30)
    assert [await commit.submit(i) for i in range(3)] == [0, 10, 20]
    assert statements.batches == [[0], [1], [2]]  # nothing waits for company

    statements.batches.clear()
    statements.hold.clear()
    results = asyncio.gather(*(commit.submit(i) for i in range(100)))
    await asyncio.sleep(0.01)
    # Both statements went out with what had come by then, 30 rows each at most...
    assert [len(b) for b in statements.batches] == [30, 30]
    late = asyncio.gather(*(commit.submit(i) for i in range(100, 110)))
    await asyncio.sleep(0.01)
    assert len(statements.batches) == 2  # ...and the rest wait for one of them to end
    statements.hold.set()
    assert await results == [i * 10 for i in range(100)]
    assert await late == [i * 10 for i in range(100, 110)]
    assert sorted(len(b) for b in statements.batches[2:]) == [20, 30]  # the 50 left, in two
    assert sorted(i for b in statements.batches for i in b) == list(range(110))
    await commit.close()


async def test_a_failed_batch_fails_each_of_its_writes_with_an_error_of_its_own() -> None:
    statements = Statements()
    statements.fail = True
    commit = GroupCommit(statements.write, error=database_error, flushes=1)
    statements.hold.clear()
    outcomes = asyncio.gather(*(commit.submit(i) for i in range(5)), return_exceptions=True)
    await asyncio.sleep(0.01)
    statements.hold.set()
    errors = await outcomes
    assert all(isinstance(e, DatabaseError) for e in errors)
    assert len({id(e) for e in errors}) == 5  # raised in five tasks: five tracebacks
    assert all(
        isinstance(e, DatabaseError) and isinstance(e.__cause__, OSError) for e in errors
    )  # the database's own error


async def test_a_write_cancelled_before_its_batch_went_out_is_not_written() -> None:
    statements = Statements()
    commit = GroupCommit(statements.write, error=database_error, flushes=1)
    statements.hold.clear()
    first = asyncio.create_task(commit.submit(1))
    await asyncio.sleep(0.01)  # out, and held: the next one waits
    second = asyncio.create_task(commit.submit(2))
    await asyncio.sleep(0.01)
    second.cancel()
    first.cancel()  # in a statement already: written all the same
    statements.hold.set()
    await asyncio.gather(first, second, return_exceptions=True)
    await commit.close()
    assert statements.batches == [[1]]


async def migrated_pool(database_url: str) -> asyncpg.Pool[asyncpg.Record]:
    pool = await create_pool(database_url, min_size=1, max_size=2, timeout_s=5.0)
    async with pool.acquire() as conn:
        await apply_migrations(conn, bundled_migrations())
    return pool


async def test_many_scans_rows_in_few_statements_each_row_its_own(database_url: str) -> None:
    pool = await migrated_pool(database_url)
    store = ScanStore(pool, instance_id=uuid.uuid4(), timeout_s=5.0)
    ids = [uuid.uuid4() for _ in range(300)]
    try:
        await asyncio.gather(
            *(
                store.create(
                    i, user_id=f"batch-{n}", image_source="data_url", image_sha256=None, user_input=None
                )
                for n, i in enumerate(ids)
            )
        )
        async with pool.acquire() as conn:
            await conn.execute("DELETE FROM scans WHERE id = $1", ids[7])  # purged meanwhile
        rows = [
            TerminalRow(
                "completed", {"answer": {"text": f"{n}"}, "situation_tags": ["a", "b"]}, {"total_ms": n}
            )
            for n in range(300)
        ]
        outcomes = await asyncio.gather(
            *(store.finish(i, r) for i, r in zip(ids, rows, strict=True)), return_exceptions=True
        )
        assert isinstance(outcomes[7], ProcessLost)  # only the row that was not there
        assert all(o is None for n, o in enumerate(outcomes) if n != 7)
        async with pool.acquire() as conn:
            stored = await conn.fetch(
                "SELECT id, status, answer, situation_tags, timings FROM scans WHERE id = ANY($1::uuid[])",
                ids,
            )
        by_id = {r["id"]: r for r in stored}
        assert len(by_id) == 299
        for n, scan_id in enumerate(ids):
            if n == 7:
                continue
            row = by_id[scan_id]
            assert row["status"] == "completed"
            assert (row["answer"], row["situation_tags"], row["timings"]) == (
                {"text": f"{n}"},
                ["a", "b"],
                {"total_ms": n},
            )
    finally:
        await store.close(5.0)
        await pool.close()


async def test_two_scans_of_one_user_and_character_in_one_statement_give_it_once(database_url: str) -> None:
    pool = await migrated_pool(database_url)
    try:
        async with pool.acquire() as conn:
            characters = await RewardStage.load_characters(conn)
        reward = RewardStage(pool, characters, frozenset(), timeout_s=5.0)
        user, other = f"reward-{uuid.uuid4()}", f"reward-{uuid.uuid4()}"
        code = characters[0].code
        rows = [(user, code, uuid.uuid4()), (other, code, uuid.uuid4()), (user, code, uuid.uuid4())]
        assert await reward._record_many(rows) == [True, True, False]
        assert await reward._record_many(rows[:1]) == [False]  # owned since
    finally:
        await pool.close()


async def test_a_drain_cancelled_with_writes_queued_fails_them_rather_than_leave_them_waiting() -> None:
    statements = Statements()
    commit = GroupCommit(statements.write, error=database_error, flushes=1)
    statements.hold.clear()
    first = asyncio.create_task(commit.submit(1))
    await asyncio.sleep(0.01)
    queued = asyncio.create_task(commit.submit(2))
    await asyncio.sleep(0.01)
    (drain,) = commit._running
    drain.cancel()  # as at the loop's end
    outcomes = await asyncio.gather(first, queued, return_exceptions=True)
    assert all(isinstance(o, DatabaseError) for o in outcomes), outcomes


async def test_a_write_queued_as_the_drains_end_gets_a_drain_of_its_own() -> None:
    # Each caller writes again as soon as its first write returns: that second write is
    # queued in the step the drain saw the queue empty and ended. (It used to wait for
    # nobody: the drain left the running set a loop turn later.)
    async def write(items: Sequence[int]) -> list[int]:
        await asyncio.sleep(0.001)
        return list(items)

    for flushes in (1, 2, 4):
        commit = GroupCommit(write, error=database_error, flushes=flushes)

        async def twice(i: int, commit: GroupCommit[int, int] = commit) -> int:
            await commit.submit(i)
            return await commit.submit(i + 100)

        async with asyncio.timeout(5):
            assert await asyncio.gather(*(twice(i) for i in range(flushes))) == [
                i + 100 for i in range(flushes)
            ]


async def test_a_row_the_database_refuses_fails_its_own_write_only_an_outage_fails_all() -> None:
    calls: list[list[int]] = []
    outage = False

    async def write(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        await asyncio.sleep(0)
        if outage:
            raise DatabaseError() from OSError("connection refused")
        if 13 in items:
            raise DatabaseError() from asyncpg.DataError("unsupported Unicode escape sequence")
        return list(items)

    commit = GroupCommit(write, error=database_error, split=row_error, flushes=1)
    first = asyncio.create_task(commit.submit(0))
    await asyncio.sleep(0)
    outcomes = await asyncio.gather(*(commit.submit(i) for i in range(10, 16)), first, return_exceptions=True)
    assert outcomes[:3] + outcomes[4:6] == [10, 11, 12, 14, 15] and outcomes[6] == 0
    assert isinstance(outcomes[3], DatabaseError) and isinstance(outcomes[3].__cause__, asyncpg.DataError)
    assert calls[1] == list(range(10, 16)) and calls[2:] == [[i] for i in range(10, 16)]  # then one by one

    calls.clear()
    outage = True
    outcomes = await asyncio.gather(*(commit.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(o, DatabaseError) for o in outcomes)
    assert calls == [[0, 1, 2]]  # not retried row by row: the database is away


async def test_a_terminal_row_postgresql_refuses_fails_that_scan_only(database_url: str) -> None:
    pool = await migrated_pool(database_url)
    store = ScanStore(pool, instance_id=uuid.uuid4(), timeout_s=5.0)
    ids = [uuid.uuid4() for _ in range(6)]
    try:
        for scan_id in ids:
            await store.create(
                scan_id, user_id="nul", image_source="data_url", image_sha256=None, user_input=None
            )
        # jsonb holds no NUL: an answer with one is refused (DataError), for its row alone.
        texts = [f"answer {n}" for n in range(6)]
        texts[2] = "a\x00b"
        rows = [TerminalRow("completed", {"answer": {"text": text}}) for text in texts]
        outcomes = await asyncio.gather(
            *(store.finish(i, r) for i, r in zip(ids, rows, strict=True)), return_exceptions=True
        )
        assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 2 + ["DatabaseError"] + ["NoneType"] * 3
        async with pool.acquire() as conn:
            statuses = await conn.fetch("SELECT status FROM scans WHERE id = ANY($1::uuid[])", ids)
        assert sorted(r["status"] for r in statuses) == ["completed"] * 5 + ["running"]
    finally:
        await store.close(5.0)
        await pool.close()
