"""Python function calls per completed scan, by module: a count, not a timing, so it
repeats exactly on a noisy box and compares two builds (or ecoscan and the lean floor)
without running them side by side.

    .venv/bin/python k6/call_counts.py                          # ecoscan
    .venv/bin/python k6/call_counts.py --app k6/lean_floor:app  # the lean floor
    .venv/bin/python k6/call_counts.py --top 60 --functions     # by function too

k6/cpu_per_scan.py's recipe at a light load (20 users for 20 s by default: the counting
slows the service several times, and a light load keeps its timing, hence its batching of
tokens and events, close to normal). The service runs this module's `app`, which wraps
the app under test and counts, with `sys.setprofile`, every Python function call and
coroutine resumption (each is a 'call' event) and every call of a C function, from the
service's first request to its shutdown, warm-up included; it divides by the scan
responses that started with 200. Counts are not costs (a dict lookup and a JPEG decode
are one call each): read them next to a profile (`cpu_per_scan.py --profile`).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCAN_PATH = "/api/v1/scan/classify/completion"
TARGET_ENV, OUT_ENV = "CALL_COUNTS_APP", "CALL_COUNTS_OUT"
PLACES = (re.compile(r"/site-packages/([A-Za-z0-9_]+)"), re.compile(r"/lib/python3\.\d+/([A-Za-z0-9_]+)"))


class CountingApp:
    """The ASGI app under test, with every call counted (see the module docstring)."""

    def __init__(self, target: str, out: Path) -> None:
        path, _, attr = target.partition(":")
        directory, _, module = path.rpartition("/")  # k6/lean_floor: uvicorn's --app-dir k6
        sys.path[:0] = [str(ROOT / directory)] if directory else [str(ROOT)]
        self.inner = getattr(importlib.import_module(module), attr)
        self.out = out
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.c_calls: collections.Counter[str] = collections.Counter()
        self.scans = 0
        self.counting = False

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if frame.f_code.co_filename == __file__:
            return  # this wrapper's own frames
        if event == "call":
            self.calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "c_call":
            self.c_calls[getattr(arg, "__qualname__", "?")] += 1

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.inner(scope, self._until_shutdown(receive), send)
            return
        if not self.counting:  # the loop's thread, from the first request on
            self.counting = True
            sys.setprofile(self._profile)
        if scope["type"] == "http" and scope["path"] == SCAN_PATH:

            async def counted_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start" and message["status"] == 200:
                    self.scans += 1
                await send(message)

            await self.inner(scope, receive, counted_send)
        else:
            await self.inner(scope, receive, send)

    def _until_shutdown(self, receive: Any) -> Any:
        async def wrapped() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                sys.setprofile(None)
                self.write()
            return dict(message)

        return wrapped

    def write(self) -> None:
        calls = [[place(path), name, n] for (path, name), n in self.calls.items()]
        document = {"scans": self.scans, "calls": calls, "c_calls": dict(self.c_calls)}
        self.out.write_text(json.dumps(document))


def place(path: str) -> str:
    """A call's package (site-packages), stdlib module, or the file's path in this repo."""
    for pattern in PLACES:
        if found := pattern.search(path):
            return found[1]
    return path.removeprefix(str(ROOT) + "/")


def report(document: dict[str, Any], top: int, functions: bool) -> str:
    scans = document["scans"] or 1
    by_place: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    for where, name, n in document["calls"]:
        by_place[where] += n
        by_function[f"{where}:{name}"] += n
    python, c = sum(by_place.values()) / scans, sum(document["c_calls"].values()) / scans
    lines = [f"{document['scans']} scans; per scan: {python:,.0f} Python calls, {c:,.0f} C calls"]
    lines.append("by module:")
    lines += [f"  {n / scans:8.1f}  {where}" for where, n in by_place.most_common(top)]
    if functions:
        lines.append("by function:")
        lines += [f"  {n / scans:8.1f}  {name}" for name, n in by_function.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--app", default="app.main:app", help="the ASGI app (k6/lean_floor:app: the floor)")
    p.add_argument("--vus", type=int, default=20)
    p.add_argument("--duration", default="20s")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--functions", action="store_true", help="the busiest functions too")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "call-counts")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    counts = args.out / "counts.json"
    counts.unlink(missing_ok=True)
    sweep = [sys.executable, str(ROOT / "k6" / "cpu_per_scan.py"), "--vus", str(args.vus)]
    sweep += ["--duration", args.duration, "--app", "k6/call_counts:app", "--out", str(args.out)]
    env = {**os.environ, TARGET_ENV: args.app, OUT_ENV: str(counts)}
    subprocess.run(sweep, check=True, env=env, stdout=subprocess.DEVNULL)
    if not counts.exists():
        print(f"the service wrote no counts ({counts}); see {args.out}/run-1/logs", file=sys.stderr)
        return 1
    print(report(json.loads(counts.read_text()), args.top, args.functions))
    return 0


if os.environ.get(TARGET_ENV) and __name__ != "__main__":  # imported by uvicorn: the service
    app = CountingApp(os.environ[TARGET_ENV], Path(os.environ[OUT_ENV]))

if __name__ == "__main__":
    sys.exit(main())
