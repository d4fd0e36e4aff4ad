"""The embedded PostgreSQL's lifecycle across real processes: each child here is a
small Python process that starts `EmbeddedPostgres`, prints its DSN and waits for a
line on stdin before stopping it, as a worker's lifespan does. One data directory is
shared by the module (initdb runs once); every test leaves no postmaster behind."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest

from app.db import embedded as database
from app.db.embedded import EmbeddedPostgres

ROOT = Path(__file__).resolve().parent.parent

# Generous: the first start runs initdb, and CI machines are slow and shared.
CHILD_START_TIMEOUT_S = 90.0
CHILD_EXIT_TIMEOUT_S = 60.0
POSTMASTER_GONE_TIMEOUT_S = 30.0
POLL_S = 0.1

CHILD = """
import asyncio, sys
from app.db.embedded import EmbeddedPostgres

async def main() -> None:
    embedded = EmbeddedPostgres(sys.argv[1])
    dsn = await embedded.start()
    print(dsn, flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await embedded.stop()

asyncio.run(main())
"""


class Child:
    """One process using the embedded server: `dsn` once it has started."""

    def __init__(self, proc: asyncio.subprocess.Process, dsn: str) -> None:
        self.proc = proc
        self.dsn = dsn

    async def exit_cleanly(self) -> None:
        """Ask it to stop the way a lifespan shutdown would, and wait for it to exit."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        await self.proc.stdin.drain()
        _, err = await asyncio.wait_for(self.proc.communicate(), CHILD_EXIT_TIMEOUT_S)
        assert self.proc.returncode == 0, err.decode(errors="replace")

    async def crash(self) -> None:
        """SIGKILL: no lifespan shutdown, no atexit handler."""
        self.proc.kill()
        await asyncio.wait_for(self.proc.communicate(), CHILD_EXIT_TIMEOUT_S)
        assert self.proc.returncode == -signal.SIGKILL


Spawn = Callable[[], Awaitable[Child]]


def postmaster_pid(data_dir: Path) -> int | None:
    """The pid the server recorded in its data directory, if the file is there."""
    try:
        return int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def postmasters(data_dir: Path) -> list[int]:
    """Every live postmaster of this data directory: backends rename themselves
    ("postgres: checkpointer"), so only a postmaster still has `-D <dir>` in its argv."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline:
            continue
        if Path(cmdline[0]).name == "postgres" and str(data_dir) in cmdline:
            found.append(proc.pid)
    return found


async def eventually(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll until the predicate holds or the (generous) bound runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


def kill_postmasters(data_dir: Path) -> None:
    """Cleanup after a failed test: SIGQUIT is PostgreSQL's immediate shutdown."""
    for pid in postmasters(data_dir):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(10)
            except psutil.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """Not under pytest's tmp_path: as root, postgres runs as pgserver's own user, and
    every pytest session that starts makes /tmp/pytest-of-<user> private again."""
    with tempfile.TemporaryDirectory(prefix="ecoscan-embedded-pg-") as tmp:
        path = Path(tmp) / "pgdata"
        try:
            yield path
        finally:
            kill_postmasters(path)


@pytest.fixture(autouse=True)
def no_postmaster_left(data_dir: Path) -> Iterator[None]:
    """Each test starts with no server and leaves none, even when it fails."""
    kill_postmasters(data_dir)
    try:
        yield
    finally:
        kill_postmasters(data_dir)


@pytest.fixture
async def spawn(data_dir: Path) -> AsyncIterator[Spawn]:
    """Starts children on the shared data directory; kills those a test leaves behind."""
    procs: list[asyncio.subprocess.Process] = []

    async def start_child() -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            str(data_dir),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), CHILD_START_TIMEOUT_S)
        if not line:
            _, err = await asyncio.wait_for(proc.communicate(), CHILD_EXIT_TIMEOUT_S)
            pytest.fail(f"child exited {proc.returncode} before printing a DSN:\n{err.decode()}")
        return Child(proc, line.decode().strip())

    try:
        yield start_child
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.communicate()


def running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


async def assert_stopped(data_dir: Path, pid: int) -> None:
    gone = await eventually(lambda: not running(pid) and not postmasters(data_dir), POSTMASTER_GONE_TIMEOUT_S)
    assert gone, f"postmaster {pid} still running: {postmasters(data_dir)}"
    assert postmaster_pid(data_dir) is None


async def select_one(dsn: str) -> int:
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        value: int = await conn.fetchval("SELECT 1")
        return value
    finally:
        await conn.close()


async def test_clean_exit_stops_the_postmaster(data_dir: Path, spawn: Spawn) -> None:
    child = await spawn()
    pid = postmaster_pid(data_dir)
    assert pid is not None and running(pid)
    assert await select_one(child.dsn) == 1

    await child.exit_cleanly()

    await assert_stopped(data_dir, pid)


async def test_after_a_crash_the_next_process_reuses_the_server_and_stops_it(
    data_dir: Path, spawn: Spawn
) -> None:
    """The reported bug: after a SIGKILL the server was never stopped again."""
    crashed = await spawn()
    pid = postmaster_pid(data_dir)
    assert pid is not None
    await crashed.crash()
    assert running(pid), "the postmaster outlives its user's SIGKILL"

    successor = await spawn()
    assert postmaster_pid(data_dir) == pid, "the running server is reused"
    assert postmasters(data_dir) == [pid], "and not duplicated"
    assert await select_one(successor.dsn) == 1

    await successor.exit_cleanly()

    await assert_stopped(data_dir, pid)


async def test_two_live_processes_share_one_server_until_the_last_exits(data_dir: Path, spawn: Spawn) -> None:
    first = await spawn()
    second = await spawn()
    pid = postmaster_pid(data_dir)
    assert pid is not None
    assert postmasters(data_dir) == [pid]

    await first.exit_cleanly()
    assert running(pid), "the second process still uses it"
    assert await select_one(second.dsn) == 1

    await second.exit_cleanly()

    await assert_stopped(data_dir, pid)


async def test_processes_exiting_together_still_stop_the_server(data_dir: Path, spawn: Spawn) -> None:
    """Each exit decides alone whether it is the last: two at once must not both
    leave it to the other."""
    children = [await spawn(), await spawn()]
    pid = postmaster_pid(data_dir)
    assert pid is not None

    await asyncio.gather(*(child.exit_cleanly() for child in children))

    await assert_stopped(data_dir, pid)


async def test_one_process_can_start_again_after_stopping(data_dir: Path) -> None:
    """pgserver's get_server() caches a handle per directory per process and would hand
    back the stopped server's; conftest's session and the service may start twice."""
    embedded = EmbeddedPostgres(str(data_dir))
    await embedded.start()
    first = postmaster_pid(data_dir)
    assert first is not None
    await embedded.stop()
    await assert_stopped(data_dir, first)

    again = EmbeddedPostgres(str(data_dir))
    dsn = await again.start()
    try:
        assert await select_one(dsn) == 1
    finally:
        await again.stop()
    assert postmaster_pid(data_dir) is None


async def test_start_gives_up_while_another_process_holds_the_start_lock(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "EMBEDDED_PG_START_TIMEOUT_S", 0.5)
    embedded = EmbeddedPostgres(str(data_dir))
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print(flush=True); sys.stdin.readline()",
        str(embedded._lock_path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        await asyncio.wait_for(holder.stdout.readline(), CHILD_START_TIMEOUT_S)
        with pytest.raises(TimeoutError):
            await embedded.start()
        assert postmaster_pid(data_dir) is None
    finally:
        holder.kill()
        await holder.communicate()
    await embedded.stop()  # nothing to leave: a no-op
