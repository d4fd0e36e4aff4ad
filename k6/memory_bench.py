"""Memory benchmark: what worst-case uploads do to the service's RSS, during and after.

Starts the service (built-in simulator, no OPENAI_API_KEY, simulator time x0.05) on a
loopback port with a fresh database, then for --rounds rounds sends, kind after kind,
--concurrency copies of each worst-case image at once (multipart uploads, each from its
own X-User-ID, read to the end of the stream), sampling the service's RSS every 20 ms.
Reports the baseline RSS (after a warm-up scan), the peak per kind and overall, and the
RSS once the service has been idle for --settle seconds.

    .venv/bin/python k6/memory_bench.py                                # this tree's app/
    .venv/bin/python k6/memory_bench.py --app-dir /tmp/imgbase         # another checkout's app/
    .venv/bin/python k6/memory_bench.py --workers 4 --kinds rgba-png   # one kind, 4 threads

The images are generated in memory from fixed shapes, so every run sends the same bytes:

    rgba-png     6300x6300 RGBA PNG, mostly transparent (39.7 Mpx, ~0.2 MB): 159 MB decoded
    jpeg-40mp    7300x5475 baseline JPEG (40.0 Mpx, the pixel limit)
    jpeg-prog    7300x5475 progressive 4:4:4 JPEG (libjpeg buffers every coefficient)
    webp-12mp    4032x3024 WebP (a phone photo; libwebp decodes at full size)
    photo        4032x3024 baseline JPEG (the everyday case, for scale)

Needs the machine's PostgreSQL (--database-url, default 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from PIL import Image, ImageDraw

from budget_bench import free_port, psql, wait_ready

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _drawn(mode: str, size: tuple[int, int], background: tuple[int, ...]) -> Image.Image:
    img = Image.new(mode, size, background)
    draw = ImageDraw.Draw(img)
    w, h = size
    for i in range(12):
        x, y = (i * 977) % (w - w // 6), (i * 613) % (h - h // 6)
        fill = ((i * 40) % 256, 255 - i * 17, (i * 70) % 256, 255)[: len(background)]
        draw.ellipse((x, y, x + w // 6, y + h // 7), fill=fill)
    for i in range(0, w, w // 40):
        draw.line((i, 0, w - i, h), fill=(30, 90, 200, 160)[: len(background)], width=7)
    return img


def _encode(img: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **params)
    return out.getvalue()


def make_images() -> dict[str, Callable[[], bytes]]:
    return {
        "rgba-png": lambda: _encode(_drawn("RGBA", (6300, 6300), (255, 255, 255, 0)), "PNG", optimize=True),
        "jpeg-40mp": lambda: _encode(_drawn("RGB", (7300, 5475), (200, 190, 170)), "JPEG", quality=92),
        "jpeg-prog": lambda: _encode(
            _drawn("RGB", (7300, 5475), (200, 190, 170)), "JPEG", quality=92, progressive=True, subsampling=0
        ),
        "webp-12mp": lambda: _encode(_drawn("RGB", (4032, 3024), (120, 140, 90)), "WEBP", quality=85),
        "photo": lambda: _encode(_drawn("RGB", (4032, 3024), (120, 140, 90)), "JPEG", quality=92),
    }


class RssSampler(threading.Thread):
    """RSS of a process tree, in MiB, every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop_event = threading.Event()

    def rss(self) -> float:
        total = 0
        for proc in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total / 2**20

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.samples.append((time.monotonic(), self.rss()))
            except psutil.Error:
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def peak(self, since: float, until: float) -> float:
        return max((rss for t, rss in self.samples if since <= t <= until), default=0.0)

    def median(self, since: float) -> float:
        return statistics.median(rss for t, rss in self.samples if t >= since)


def scan(client: httpx.Client, name: str, data: bytes, user: str) -> str:
    """POST one upload and read the stream; the outcome as `200 done`, `413 IMAGE_...`."""
    files = {"image": (name, data, "application/octet-stream")}
    with client.stream(
        "POST", "/api/v1/scan/classify/completion", files=files, headers={"X-User-ID": user}
    ) as response:
        if response.status_code != 200:
            response.read()
            return f"{response.status_code} {response.json().get('code')}"
        last = "?"
        for line in response.iter_lines():
            if line.startswith("event:"):
                last = line.split(":", 1)[1].strip()
        return f"200 {last}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU_MAX_WORKERS")
    p.add_argument("--concurrency", type=int, default=0, help="uploads at once (default: --workers)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before the idle-after RSS")
    p.add_argument("--kinds", default="rgba-png,jpeg-40mp,jpeg-prog,webp-12mp,photo")
    p.add_argument("--app-dir", type=Path, default=ROOT, help="the checkout whose app/ is served")
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--out", type=Path, default=ROOT / "k6" / "results" / "memory")
    p.add_argument("--set", action="append", default=[], help="extra service env KEY=VALUE")
    args = p.parse_args()
    concurrency = args.concurrency or args.workers
    args.out.mkdir(parents=True, exist_ok=True)
    generators = make_images()
    kinds = [k for k in args.kinds.split(",") if k]
    images = {kind: generators[kind]() for kind in kinds}

    db = f"ecoscan_memory_{os.getpid()}"
    psql(args.database_url, f'CREATE DATABASE "{db}"')
    dsn = args.database_url.rsplit("/", 1)[0] + "/" + db
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.update(
        {
            "DATABASE_URL": dsn,
            "CPU_MAX_WORKERS": str(args.workers),
            "SIM_TIME_SCALE": "0.05",
            "LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(args.app_dir),
        }
    )
    env.update(kv.split("=", 1) for kv in args.set)
    cmd = [str(BIN / "uvicorn"), "app.main:app", "--app-dir", str(args.app_dir), "--port", str(port)]
    if (args.app_dir / "app" / "http_protocol.py").exists():
        cmd += ["--http", "app.http.protocol:HttpToolsProtocol"]
    log = open(args.out / "service.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([*cmd, "--no-access-log"], cwd=args.app_dir, env=env, stdout=log, stderr=log)
    lines: list[str] = []
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz")
        sampler = RssSampler(proc.pid)
        sampler.start()
        timeout = httpx.Timeout(120.0)
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as client,
            ThreadPoolExecutor(concurrency) as pool,
        ):
            warm = generators["photo"]() if "photo" not in images else images["photo"]
            scan(client, "warm.jpg", warm, "warm-up")
            time.sleep(2.0)
            baseline = sampler.median(time.monotonic() - 1.0)
            per_kind: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
            outcomes: dict[str, dict[str, int]] = {kind: {} for kind in kinds}
            started = time.monotonic()
            for round_no in range(args.rounds):
                for kind in kinds:
                    t0 = time.monotonic()
                    before = sampler.rss()
                    users = [f"mem-{round_no}-{kind}-{i}" for i in range(concurrency)]
                    results = list(pool.map(lambda u, k=kind: scan(client, k, images[k], u), users))
                    t1 = time.monotonic()
                    per_kind[kind].append((before, sampler.peak(t0, t1), t1 - t0))
                    for result in results:
                        outcomes[kind][result] = outcomes[kind].get(result, 0) + 1
            ended = time.monotonic()
        time.sleep(args.settle)
        idle = sampler.median(time.monotonic() - 1.0)
        peak = sampler.peak(started, ended)
        sampler.stop()
        lines = [
            f"app_dir={args.app_dir} CPU_MAX_WORKERS={args.workers} concurrency={concurrency} "
            f"rounds={args.rounds} settle={args.settle}s",
            f"RSS baseline {baseline:.0f} MiB, peak {peak:.0f} MiB (+{peak - baseline:.0f}), "
            f"idle after {idle:.0f} MiB (+{idle - baseline:.0f})",
            "per kind: RSS before -> peak of each burst (MiB) and its duration, outcomes",
            *(
                f"  {kind:10s} {len(images[kind]) / 1e6:5.2f} MB  "
                + "  ".join(f"{b:4.0f}->{p:4.0f} {s:4.1f}s" for b, p, s in per_kind[kind])
                + f"   {json.dumps(outcomes[kind])}"
                for kind in kinds
            ),
        ]
        text = "\n".join(lines)
        print(text)
        (args.out / "report.txt").write_text(text + "\n")
        samples = [(round(t - started, 3), rss) for t, rss in sampler.samples]
        (args.out / "rss.json").write_text(json.dumps(samples))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        psql(args.database_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
