"""The embedded PostgreSQL that runs when no `DATABASE_URL` is set: the server binaries
of the `pgserver` wheel, data in a local directory reused across runs."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


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
