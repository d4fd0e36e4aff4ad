"""CPU% and RSS of the processes under test, sampled in a thread while k6 runs, and
the exact CPU seconds each tree used over the run (from the kernel's counters, not the
samples: `cpu_s`, what CPU per completed scan is computed from).

A process tree, not one process: uvicorn --workers and the CPU lane's children count
towards the service.
"""

from __future__ import annotations

import contextlib
import threading

import psutil


class Sampler(threading.Thread):
    """Samples CPU% (100 = one core busy) and RSS of process trees every `interval` seconds."""

    def __init__(self, roots: dict[str, int], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.roots = roots
        self.interval = interval
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in roots}
        self._stop_event = threading.Event()
        self._procs: dict[int, psutil.Process] = {}
        # Per pid: user+system CPU seconds when first seen, and at the latest sample.
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._members: dict[str, set[int]] = {name: set() for name in roots}

    def add(self, name: str, pid: int) -> None:
        """Also sample `pid` (e.g. k6, started after the sampler)."""
        self.samples.setdefault(name, [])
        self.roots = {**self.roots, name: pid}

    def _tree(self, pid: int) -> list[psutil.Process]:
        """The live members of `pid`'s tree, reusing known Process objects: psutil's
        cpu_percent is the CPU used since the previous call on the same object."""
        try:
            root = psutil.Process(pid)
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        out = []
        for p in members:
            known = self._procs.get(p.pid)
            if known is None:
                known = self._procs[p.pid] = p
                with contextlib.suppress(psutil.Error):
                    known.cpu_percent(None)  # first call primes the counter
            out.append(known)
        return out

    def _sample(self, name: str, pid: int) -> tuple[float, float]:
        cpu = rss = 0.0
        for p in self._tree(pid):
            with contextlib.suppress(psutil.Error):
                cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
                self._count_cpu_seconds(name, p)
        return cpu, rss / 2**20

    def _count_cpu_seconds(self, name: str, p: psutil.Process) -> None:
        times = p.cpu_times()
        seconds = times.user + times.system
        self._cpu_first.setdefault(p.pid, seconds)
        self._cpu_last[p.pid] = seconds
        self._members.setdefault(name, set()).add(p.pid)

    def cpu_seconds(self, name: str) -> float:
        """CPU seconds `name`'s tree used between the first and the last sample."""
        return sum(self._cpu_last[pid] - self._cpu_first[pid] for pid in self._members.get(name, ()))

    def run(self) -> None:
        for name, pid in self.roots.items():
            for p in self._tree(pid):
                with contextlib.suppress(psutil.Error):
                    self._count_cpu_seconds(name, p)
        while not self._stop_event.wait(self.interval):
            for name, pid in list(self.roots.items()):
                self.samples[name].append(self._sample(name, pid))

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling; per name: cpu_avg, cpu_max, rss_max_mb and the sample count."""
        self._stop_event.set()
        self.join(timeout=5)
        for name, pid in self.roots.items():  # a last reading of the counters
            for p in self._tree(pid):
                with contextlib.suppress(psutil.Error):
                    self._count_cpu_seconds(name, p)
        out = {}
        for name, rows in self.samples.items():
            cpus = [c for c, _ in rows] or [0.0]
            rss = [r for _, r in rows] or [0.0]
            out[name] = {
                "cpu_avg": sum(cpus) / len(cpus),
                "cpu_max": max(cpus),
                "rss_max_mb": max(rss),
                "cpu_s": self.cpu_seconds(name),
                "samples": len(rows),
            }
        return out
