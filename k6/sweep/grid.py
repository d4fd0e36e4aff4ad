"""The grid: which points a sweep runs, and the name and hash each one is stored under.

A point's config (settings, load level, fixed options) is hashed into its file name, so
a re-run finds the points already done and a changed option makes new ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from app.settings import Settings, env_name

# Grid axes with their own flags: flag dest -> service env var.
AXIS_FLAGS = {
    "max_workers": "CPU_MAX_WORKERS",
    "vision_concurrency": "VISION_CONCURRENCY",
    "answer_concurrency": "ANSWER_CONCURRENCY",
}
# Short names for the tables, progress lines and CSV columns.
ALIASES = {"CPU_MAX_WORKERS": "max_workers"}
UNLIMITED_RPM = 1_000_000
UNLIMITED_TPM = 1_000_000_000


@dataclass(frozen=True)
class FixedOptions:
    """The options every point of a sweep shares; part of each point's config and hash."""

    scenario: str
    duration: str
    form: str
    image_set: str
    warmup_s: float
    workers: int
    sim_time_scale: float
    sim_rpm: int
    sim_tpm: int
    sim_unlimited: bool
    sim_set: tuple[tuple[str, str], ...]
    service_rpm: int
    service_tpm: int
    k6_env: tuple[tuple[str, str], ...]
    access_log: bool
    app: str = "app.main:app"  # the ASGI app uvicorn serves (k6/lean_floor.py: the reference floor)


@dataclass(frozen=True)
class Point:
    """One run: service settings (env var -> value) at one load level."""

    settings: tuple[tuple[str, str], ...]
    level: int | float
    fixed: FixedOptions

    @property
    def config(self) -> dict[str, Any]:
        return {"settings": dict(self.settings), "level": self.level, **dataclasses.asdict(self.fixed)}

    @property
    def key(self) -> str:
        blob = json.dumps(self.config, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @property
    def label(self) -> str:
        return config_label(dict(self.settings))

    @property
    def level_name(self) -> str:
        return "rate" if self.fixed.scenario == "arrival" else "vus"

    @property
    def stem(self) -> str:
        """File name stem of everything this point writes (result, summary, logs)."""
        safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{self.label}_{self.level_name}={self.level}")
        return f"{safe}-{self.key}"

    @property
    def filename(self) -> str:
        return f"{self.stem}.json"


def short(env: str) -> str:
    return ALIASES.get(env, env.lower())


def config_label(settings: dict[str, str]) -> str:
    return " ".join(f"{short(k)}={v}" for k, v in settings.items()) or "defaults"


def number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def service_env_names() -> set[str]:
    """The env vars the service reads, one per Settings field: a misspelt axis is caught
    before a long sweep rather than silently measuring the defaults."""
    return {env_name(f.name) for f in dataclasses.fields(Settings) if not f.metadata.get("env_prefix")}


def build_grid(args: argparse.Namespace) -> list[Point]:
    axes: list[tuple[str, list[str]]] = [
        (env, getattr(args, dest)) for dest, env in AXIS_FLAGS.items() if getattr(args, dest)
    ]
    axes += [(key.upper(), values) for key, values in args.sets]
    known = service_env_names()
    for name, _ in axes:
        if name not in known:
            print(f"warning: {name} is not a field of app.settings.Settings; the service will ignore it")
    levels = args.rates if args.scenario == "arrival" else args.vus
    if not levels:
        raise SystemExit("give load levels: --rates for the arrival scenario, --vus otherwise")
    fixed = fixed_options(args)
    names = [name for name, _ in axes]
    return [
        Point(tuple(zip(names, combo, strict=True)), number(level), fixed)
        for combo in itertools.product(*[values for _, values in axes])
        for level in levels
    ]


def fixed_options(args: argparse.Namespace) -> FixedOptions:
    return FixedOptions(
        scenario=args.scenario,
        duration=args.duration,
        form=args.form,
        image_set=args.image_set,
        warmup_s=args.warmup,
        workers=args.workers,
        sim_time_scale=args.sim_time_scale,
        sim_rpm=args.sim_rpm,
        sim_tpm=args.sim_tpm,
        sim_unlimited=args.sim_rpm == 0 and args.sim_tpm == 0,
        sim_set=tuple(sorted(args.sim_set)),
        # The service's budget follows the simulator's limit unless given.
        service_rpm=args.service_rpm or (UNLIMITED_RPM if args.sim_rpm == 0 else args.sim_rpm),
        service_tpm=args.service_tpm or (UNLIMITED_TPM if args.sim_tpm == 0 else args.sim_tpm),
        k6_env=tuple(sorted(args.k6_env)),
        access_log=args.access_log,
        app=args.app,
    )


def parse_duration(text: str) -> float:
    """k6 durations: 90s, 2m, 1m30s, 500ms, 1h."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a k6 duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def expected_run_s(point: Point) -> float:
    """How long the point's k6 run should take, before the graceful stop."""
    fixed = point.fixed
    extra = dict(fixed.k6_env)
    run = parse_duration(fixed.duration)
    if fixed.scenario == "scan":
        if "STAGES" in extra:
            return sum(parse_duration(s.split(":")[0]) for s in extra["STAGES"].split(","))
        run += parse_duration(extra.get("RAMP_UP", "60s")) + parse_duration(extra.get("RAMP_DOWN", "30s"))
    return run
