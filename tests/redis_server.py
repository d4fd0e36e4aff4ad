"""Real Redis for the tests: the machine's server when one answers, or one we start.

`shared_redis_url()` is what most tests use: the server on 127.0.0.1:6379 when it
answers, else a `redis-server` this test session starts (and stops). Tests never flush
a database: each takes a fresh key prefix and deletes only keys under it.

`RedisServer` is a private `redis-server` on a free port, for tests that stop, freeze
and restart the server under the service (`stop`, `freeze`, `thaw`, `start`, `kill`);
`persistent=True` keeps every write in an append-only file (fsynced per write) in its
temp directory, which a start after `kill` loads again.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from tests.service_process import free_port

MACHINE_REDIS = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 10.0


def answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def fresh_prefix() -> str:
    return f"ecoscan-test-{os.getpid()}-{secrets.token_hex(4)}"


def delete_prefix(url: str, prefix: str) -> None:
    """Delete this test's keys (and only them); a server that is gone has none to delete."""
    with contextlib.suppress(redis.RedisError, OSError):
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


class RedisServer:
    """A `redis-server` of our own on a free loopback port, keeping nothing on disk unless
    `persistent`."""

    def __init__(self, *, persistent: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self._binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="ecoscan-test-redis-")
        self._process: subprocess.Popen[bytes] | None = None
        self._persistent = persistent

    def start(self) -> None:
        options = {"bind": "127.0.0.1", "port": str(self.port), "save": "", "appendonly": "no"}
        if self._persistent:
            options.update(appendonly="yes", appendfsync="always")
        argv = [self._binary, "--dir", self._dir.name]
        for name, value in options.items():
            argv += [f"--{name}", value]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers(self.url):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None:
            self.thaw()
            self._process.terminate()
            try:
                self._process.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=START_TIMEOUT_S)
            self._process = None

    def kill(self) -> None:
        """SIGKILL (a crash, or a supervisor giving up on a hung server): nothing is saved
        on the way out; a persistent server's next start loads what it had written."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=START_TIMEOUT_S)
            self._process = None

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a hung server)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


def shared_redis_url() -> tuple[str, RedisServer | None]:
    """The machine's Redis if it answers, else a server of our own (the caller stops it)."""
    if answers(MACHINE_REDIS):
        return MACHINE_REDIS, None
    server = RedisServer()
    server.start()
    return server.url, server
