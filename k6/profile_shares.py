"""Where the service's CPU goes, from a py-spy profile in raw (collapsed) format, as
`k6/sweep --profile` and `k6/cpu_per_scan.py --profile` write it.

    .venv/bin/python k6/profile_shares.py k6/results/cpu-per-scan/run-1/points/*.py-spy.txt

Prints three tables, each as a share of all samples:
- self: the package (or `app/` module) of the innermost frame, where the CPU was spent;
- inclusive: samples with the package anywhere on the stack (what a layer costs with
  everything it calls; these overlap, so they do not add up);
- the innermost functions with the most samples.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")
SITE = re.compile(r"/site-packages/(?P<pkg>[A-Za-z0-9_]+)")
STDLIB = re.compile(r"/lib/python3\.\d+/(?P<mod>[A-Za-z0-9_]+)")
APP = re.compile(r"(?:^|/)app/(?P<mod>[A-Za-z0-9_/]+)\.py$")


def layer(file: str) -> str:
    if m := SITE.search(file):
        return m["pkg"]
    if m := APP.search(file):
        return "app/" + m["mod"]
    if m := STDLIB.search(file):
        return m["mod"]
    return file or "?"


def stacks(path: Path) -> Iterator[tuple[list[tuple[str, str]], int]]:
    """(frames from outermost to innermost as (function, layer), samples) per line."""
    for line in path.read_text(errors="replace").splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        frames = []
        for raw in body.split(";"):
            if m := FRAME.match(raw):
                frames.append((m["func"], layer(m["file"])))
        if frames:
            yield frames, int(count)


def shares(paths: list[Path]) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for path in paths:
        for frames, n in stacks(path):
            total += n
            func, where = frames[-1]
            own[where] += n
            leaves[f"{where}:{func}"] += n
            for seen in {w for _, w in frames}:
                inclusive[seen] += n
    return total, own, inclusive, leaves


def table(title: str, counts: Counter[str], total: int, top: int) -> str:
    rows = [f"{title}:"]
    for name, n in counts.most_common(top):
        rows.append(f"  {100 * n / total:5.1f} %  {name}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    total, own, inclusive, leaves = shares(args.profiles)
    if not total:
        print("no samples", file=sys.stderr)
        return 1
    print(f"{total} samples")
    print(table("self, by package", own, total, args.top))
    print(table("inclusive, by package", inclusive, total, args.top))
    print(table("self, by function", leaves, total, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
