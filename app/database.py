"""PostgreSQL: where the server comes from, the asyncpg pool, and migrations.

With no `DATABASE_URL` the service runs an embedded PostgreSQL from the `pgserver`
package (server binaries shipped in the wheel, data in a local directory reused
across runs). Migrations are the SQL files in `app/data/migrations`, applied in
name order at start-up under an advisory lock so two workers starting together
apply them once. Each file is idempotent, and a file is re-applied when its text
changes (its checksum is recorded), so editing seed data takes effect on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import orjson

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    # A plain connection or one borrowed from the pool: both run queries the same way.
    DbConn = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

# Any constant works; it only has to be the same in every worker.
_MIGRATION_LOCK_ID = 0x6563_6F73_6361_6E


@dataclass(frozen=True)
class Migration:
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def bundled_migrations() -> list[Migration]:
    folder = resources.files("app") / "data" / "migrations"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [Migration(f.name, f.read_text(encoding="utf-8")) for f in files]


async def apply_migrations(conn: DbConn, migrations: list[Migration]) -> list[str]:
    """Apply what is new or changed; return the names applied."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK_ID)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   name text PRIMARY KEY,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {
            r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_migrations")
        }
        for m in migrations:
            if done.get(m.name) == m.checksum:
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    """INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)
                       ON CONFLICT (name) DO UPDATE
                       SET checksum = EXCLUDED.checksum, applied_at = now()""",
                    m.name,
                    m.checksum,
                )
            applied.append(m.name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK_ID)
    return applied


# Bounds on the embedded server's blocking work (each run in a thread). Starting covers
# waiting for another process's start or stop, initdb on first use (seconds) and pg_ctl
# start; stopping covers that wait and a fast shutdown, then an immediate one.
EMBEDDED_PG_START_TIMEOUT_S = 120.0
EMBEDDED_PG_STOP_TIMEOUT_S = 60.0
# The thread's own steps end by the deadline above (a program is killed when it is due,
# a wait gives up); the await gives up on the thread this much later, as a backstop.
_THREAD_GRACE_S = 10.0
# How often a process waiting for another's start or stop, or for "ready", looks again.
_LOCK_POLL_S = 0.05
# pgserver's conventions, kept so that a data directory it created is reused as it is.
_SUPERUSER = "postgres"  # the role initdb creates; the DSN connects as it
_ROOT_RUNS_AS = "pgserver"  # postgres refuses to run as root: pgserver's own user then
_INITDB_ARGS = ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", _SUPERUSER]


class EmbeddedPostgres:
    """A PostgreSQL in a local data directory, one postmaster per directory, shared by
    every process that uses it and stopped when the last of them exits cleanly.

    pgserver ships the binaries; the lifecycle is ours. pgserver's own handle counts
    users in a list of pids in the data directory and stops the server only when the
    exiting pid is the last one listed, so a SIGKILLed user's pid stays listed for good
    and the server is left running on every later exit; its start also waits for
    "ready" without a bound, under a lock shared by every pgserver user on the machine.
    Instead each user holds a shared flock on `<dir>.users` for as long as it uses the
    server: the kernel drops it when the process dies, however it dies, and pid reuse
    cannot fake a user. Starting (initdb, finding the postmaster through postmaster.pid
    or pg_ctl start) and the stop-or-not decision are serialised by an exclusive flock
    on `<dir>.lock`, so a process that starts while another stops either waits for the
    stop to finish and starts a new postmaster, or registers before the stopper looks
    and keeps it running. Every step is bounded by the caller's deadline.
    """

    def __init__(self, data_dir: str) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        # Beside the data directory: initdb wants it empty, and the lock comes first.
        self._lock_path = self.data_dir.with_name(self.data_dir.name + ".lock")
        self._users_path = self.data_dir.with_name(self.data_dir.name + ".users")
        # The OS user postgres runs as: pgserver's own when we are root (postgres refuses
        # root), else None (ourselves). Known once started; pg_ctl must run as it too.
        self.system_user: str | None = None
        self._user_fd: int | None = None
        self._state = threading.Lock()  # guards _user_fd and _abandoned across the thread
        self._abandoned = False

    async def start(self) -> str:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + EMBEDDED_PG_START_TIMEOUT_S
        thread = asyncio.to_thread(self._start_blocking, deadline)
        try:
            return await asyncio.wait_for(thread, EMBEDDED_PG_START_TIMEOUT_S + _THREAD_GRACE_S)
        except BaseException:
            await self._abandon_start()
            raise

    async def stop(self) -> None:
        with self._state:
            fd, self._user_fd = self._user_fd, None
        if fd is not None:
            await self._leave(fd)

    def _start_blocking(self, deadline: float) -> str:
        with _exclusive_flock(self._lock_path, deadline):
            self._prepare_data_dir()
            if not (self.data_dir / "PG_VERSION").exists():
                _check(self._run("initdb", _INITDB_ARGS, deadline))
            uri = self._ready_uri(deadline)
            if uri is None:
                self._pg_ctl_start(deadline)
                uri = self._ready_uri(deadline)
                if uri is None:
                    raise RuntimeError(f"embedded PostgreSQL exited at start; see {self.data_dir / 'log'}")
            else:
                log.info("embedded PostgreSQL already running in %s: reusing it", self.data_dir)
            fd = _shared_flock(self._users_path)
        with self._state:
            if not self._abandoned:
                self._user_fd = fd
                return uri
        # start() gave up on us: leave as a clean exit would.
        self._leave_blocking(fd, time.monotonic() + EMBEDDED_PG_STOP_TIMEOUT_S)
        raise TimeoutError("embedded PostgreSQL start finished after start() gave up")

    def _prepare_data_dir(self) -> None:
        """Create it; as root also what pgserver does so that its own user can run
        postgres there: the user, traversable parents and binaries, the directory's owner."""
        self.data_dir.mkdir(exist_ok=True)
        if os.geteuid() != 0:
            return
        import pwd
        import stat

        from pgserver._commands import POSTGRES_BIN_PATH
        from pgserver.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

        ensure_user_exists(_ROOT_RUNS_AS)
        ensure_prefix_permissions(self.data_dir)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        readable = stat.S_IRGRP | stat.S_IROTH
        ensure_folder_permissions(POSTGRES_BIN_PATH, readable | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", readable)
        entry = pwd.getpwnam(_ROOT_RUNS_AS)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.system_user = _ROOT_RUNS_AS

    def _ready_uri(self, deadline: float) -> str | None:
        """The DSN of this directory's postmaster once it accepts connections; None when
        none runs (no postmaster.pid, or a stale one whose process is gone)."""
        from pgserver.utils import PostmasterInfo

        while True:
            try:
                info = PostmasterInfo.read_from_pgdata(self.data_dir)
            except (AssertionError, ValueError):
                pass  # read while the postmaster was still writing it
            else:
                if info is None or not info.is_running():
                    return None
                if info.status == "ready":
                    uri: str = info.get_uri(_SUPERUSER)
                    return uri
            if time.monotonic() >= deadline:
                raise TimeoutError(f"embedded PostgreSQL in {self.data_dir} is not ready")
            time.sleep(_LOCK_POLL_S)

    def _pg_ctl_start(self, deadline: float) -> None:
        """Listen on a Unix socket only (no port to collide on), in the data directory
        unless that path is too long for a socket name; log to `<dir>/log`."""
        from pgserver.postgres_server import PostgresServer
        from pgserver.utils import ensure_prefix_permissions, find_suitable_socket_dir

        socket_dir = find_suitable_socket_dir(self.data_dir, PostgresServer.runtime_path)
        if self.system_user is not None and socket_dir != self.data_dir:
            ensure_prefix_permissions(socket_dir)
            socket_dir.chmod(0o777)
        wait = ["-w", "-t", _whole_seconds(deadline - time.monotonic())]
        options = ["-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(self.data_dir / "log")]
        _check(self._run("pg_ctl", [*wait, *options, "start"], deadline))
        log.info("embedded PostgreSQL started in %s", self.data_dir)

    async def _abandon_start(self) -> None:
        """start() timed out or was cancelled: a start still running in its thread leaves
        again when it ends; one that ended just now is left here (no stop() will come)."""
        with self._state:
            self._abandoned = True
            fd, self._user_fd = self._user_fd, None
        if fd is not None:
            await self._leave(fd)

    async def _leave(self, fd: int) -> None:
        deadline = time.monotonic() + EMBEDDED_PG_STOP_TIMEOUT_S
        thread = asyncio.to_thread(self._leave_blocking, fd, deadline)
        await asyncio.wait_for(thread, EMBEDDED_PG_STOP_TIMEOUT_S + _THREAD_GRACE_S)

    def _leave_blocking(self, fd: int, deadline: float) -> None:
        """Stop being a user; stop the postmaster if no other process is one."""
        try:
            with _exclusive_flock(self._lock_path, deadline):
                os.close(fd)
                fd = -1
                if not _unused(self._users_path):
                    log.info("embedded PostgreSQL left running: another process still uses it")
                    return
                self._stop_postmaster(deadline)
        finally:
            if fd >= 0:
                os.close(fd)

    def _stop_postmaster(self, deadline: float) -> None:
        """A fast shutdown (disconnects clients) with half the time left, then an
        immediate one (what a crash would do; WAL replay recovers at the next start)."""
        for mode, share in (("fast", 0.5), ("immediate", 1.0)):
            if not (self.data_dir / "postmaster.pid").exists():
                break
            wait_s = (deadline - time.monotonic()) * share
            if wait_s <= 0:
                break
            self._pg_ctl_stop(mode, wait_s)
        if (self.data_dir / "postmaster.pid").exists():
            log.error("embedded PostgreSQL in %s did not stop; the next start reuses it", self.data_dir)
        else:
            log.info("embedded PostgreSQL stopped (last user exited)")

    def _pg_ctl_stop(self, mode: str, wait_s: float) -> None:
        args = ["-m", mode, "-w", "-t", _whole_seconds(wait_s), "stop"]
        try:
            code, output = self._run("pg_ctl", args, time.monotonic() + wait_s + 1)
        except TimeoutError:
            log.warning("pg_ctl stop -m %s did not finish in %.0f s", mode, wait_s)
            return
        if code != 0:
            log.warning("pg_ctl stop -m %s: %s", mode, output.strip())

    def _run(self, program: str, args: list[str], deadline: float) -> tuple[int, str]:
        """One of pgserver's programs on the data directory, as the user postgres runs as,
        killed at the deadline. Output goes to a file: a pipe inherited by the postmaster
        that pg_ctl starts would never close."""
        from pgserver._commands import POSTGRES_BIN_PATH

        command = [str(POSTGRES_BIN_PATH / program), "-D", str(self.data_dir), *args]
        with tempfile.TemporaryFile("w+") as output:
            try:
                done = subprocess.run(
                    command,
                    user=self.system_user,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=max(0.0, deadline - time.monotonic()),
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{program} did not finish in time") from None
            output.seek(0)
            return done.returncode, output.read()


def _check(result: tuple[int, str]) -> None:
    code, output = result
    if code != 0:
        raise RuntimeError(f"embedded PostgreSQL: exit status {code}:\n{output}")


def _whole_seconds(seconds: float) -> str:
    """pg_ctl's -t takes whole seconds, at least one."""
    return str(max(1, int(seconds)))


@contextlib.contextmanager
def _exclusive_flock(path: Path, deadline: float) -> Iterator[None]:
    """Hold an exclusive flock on `path`, waiting for it until `deadline` (monotonic)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while not _try_flock(fd, fcntl.LOCK_EX):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path} is still held by another process")
            time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the flock


def _shared_flock(path: Path) -> int:
    """A shared flock on `path`, held until the returned fd is closed or the process
    dies. Taken under the exclusive start lock, as the only exclusive taker of this file
    (`_unused`) is, so it is always free."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if not _try_flock(fd, fcntl.LOCK_SH):
        os.close(fd)
        raise RuntimeError(f"{path} is locked exclusively outside the start lock")
    return fd


def _unused(path: Path) -> bool:
    """True when no process (this one's handle must be closed first) holds `path`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return _try_flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


async def create_pool(
    dsn: str, *, min_size: int, max_size: int, timeout_s: float
) -> asyncpg.Pool[asyncpg.Record]:
    return await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        command_timeout=timeout_s,
        timeout=timeout_s,
        # JSON columns come back as Python objects, not strings.
        init=_init_connection,
        reset=_keep_session,
    )


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """What a released connection gets beyond asyncpg's own cleanup (an open transaction
    rolled back, listeners dropped): nothing. The default reset query (`SELECT
    pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`) is one more round trip
    per release, three per scan, for session state this service never leaves on a pooled
    connection: LISTEN has its own connection (app/stages/rule.py), the migration lock is
    released where it is taken, and nothing SETs session variables."""


# Every connection of a process carries this tag and its instance id as its
# `application_name`, which is how other processes tell a live one from a dead one.
INSTANCE_TAG_PREFIX = "ecoscan "


def instance_tag(instance_id: uuid.UUID) -> str:
    return f"{INSTANCE_TAG_PREFIX}{instance_id}"


def tagged_dsn(dsn: str, instance_id: uuid.UUID) -> str:
    """`dsn` with `application_name` set to this instance's tag (asyncpg passes unknown
    query parameters on as server settings)."""
    parts = urllib.parse.urlsplit(dsn)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "application_name"]
    query.append(("application_name", instance_tag(instance_id)))
    return urllib.parse.urlunsplit(
        parts._replace(query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote))
    )


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb", encoder=_jsonb_binary, decoder=_jsonb_value, schema="pg_catalog", format="binary"
    )


def _jsonb_binary(value: object) -> bytes:
    """A jsonb parameter in PostgreSQL's binary format: a version byte (1), then the JSON
    text (orjson: compact UTF-8, no str round trip)."""
    return b"\x01" + orjson.dumps(value)


def _jsonb_value(data: bytes) -> object:
    return orjson.loads(data[1:])
