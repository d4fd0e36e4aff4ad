"""The grid: which points a sweep runs, in which order, and the name and hash each run
is stored under.

A run's config (settings, load level, fixed options, repeat) is hashed into its file
name, so a re-run finds the runs already done and a changed option makes new ones.
With `--repeat N` the whole grid runs N times in turn (rounds), not each point N times
in a row: this box's speed drifts by several per cent within an hour, and a point run
N times back to back would carry that drift as if it were the setting's effect. Even
rounds run the grid backwards, so a drift that is linear in time gives every point the
same mean position in the sweep.

A grid value `auto` asks the service to size the setting itself. A service whose
Settings cannot read `auto` for it gets the variable unset (its default) instead; the
config says so (`auto_unset`), so the two never share a result file.
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

from app.settings import Settings, SettingsError, env_name

# Grid axes with their own flags: flag dest -> service env var.
AXIS_FLAGS = {
    "max_workers": "CPU_MAX_WORKERS",
    "vision_concurrency": "VISION_CONCURRENCY",
    "answer_concurrency": "ANSWER_CONCURRENCY",
}
# Short names for the tables, progress lines and CSV columns.
ALIASES = {"CPU_MAX_WORKERS": "max_workers"}
AUTO = "auto"
# The settings a service may size itself (`auto`): what `--auto-point` sets to auto.
AUTO_SIZED = (
    "CPU_MAX_WORKERS",
    "CPU_QUEUE_LIMIT",
    "VISION_CONCURRENCY",
    "ANSWER_CONCURRENCY",
    "MAX_INFLIGHT_SCANS",
)
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
    repeat: int = 1  # which round of `--repeat`, from 1
    auto_unset: tuple[str, ...] = ()  # `auto` settings the service cannot read: left unset

    @property
    def config(self) -> dict[str, Any]:
        config = {"settings": dict(self.settings), "level": self.level, **dataclasses.asdict(self.fixed)}
        # Only when they say something: a single-round sweep keeps the hashes (and the
        # result files) it had before repeats existed.
        if self.repeat > 1:
            config["repeat"] = self.repeat
        if self.auto_unset:
            config["auto_unset"] = list(self.auto_unset)
        return config

    @property
    def cell(self) -> Point:
        """The grid point this run repeats (its first round): what the reports group by."""
        return dataclasses.replace(self, repeat=1)

    @property
    def is_auto(self) -> bool:
        return any(sized_by_service(value) for _, value in self.settings)

    def service_settings(self) -> dict[str, str]:
        """The env vars the service gets: `auto` ones it cannot read are left out."""
        return {k: v for k, v in self.settings if not (sized_by_service(v) and k in self.auto_unset)}

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
        """File name stem of everything this run writes (result, summary, logs)."""
        name = f"{self.label}_{self.level_name}={self.level}"
        name += f"_r{self.repeat}" if self.repeat > 1 else ""
        safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
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


def sized_by_service(value: str) -> bool:
    """`auto`, or `auto:N` (sized by the service, at most N)."""
    return value == AUTO or value.startswith(AUTO + ":")


def accepts_auto(name: str) -> bool:
    """Whether the service's Settings read `auto` for the env var `name`."""
    try:
        Settings.from_env({name: AUTO})
    except (SettingsError, ValueError, TypeError):
        return False
    return True


def build_grid(args: argparse.Namespace) -> list[Point]:
    """Every run of the sweep, in the order to run them."""
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
    if args.auto_point:
        axes = with_auto_point(axes)
    unset = tuple(
        name for name, values in axes if any(map(sized_by_service, values)) and not accepts_auto(name)
    )
    for name in unset:
        print(f"note: the service cannot read {name}=auto yet; its `auto` points leave it unset (default)")
    names = [name for name, _ in axes]
    combos = list(dict.fromkeys(itertools.product(*[values for _, values in axes])))
    if args.auto_point:  # the grid's numbers, plus one point sized by the service
        combos = [c for c in combos if all_or_no_auto(names, c)]
    cells = [
        Point(tuple(zip(names, combo, strict=True)), number(level), fixed_options(args))
        for combo in combos
        for level in levels
    ]
    cells = [
        dataclasses.replace(
            c, auto_unset=tuple(n for n in unset if sized_by_service(dict(c.settings).get(n, "")))
        )
        for c in cells
    ]
    return interleave(cells, args.repeat)


def with_auto_point(axes: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """`--auto-point`: `auto` added to every axis of a setting that sizes itself."""
    return [(n, v if n not in AUTO_SIZED or any(map(sized_by_service, v)) else [*v, AUTO]) for n, v in axes]


def all_or_no_auto(names: list[str], combo: tuple[str, ...]) -> bool:
    """With `--auto-point`: every self-sizing setting `auto`, or none of them."""
    sized = [sized_by_service(v) for name, v in zip(names, combo, strict=True) if name in AUTO_SIZED]
    return all(sized) or not any(sized)


def interleave(cells: list[Point], repeats: int) -> list[Point]:
    """`repeats` rounds over the whole grid, every even round backwards (see the module doc)."""
    runs = []
    for repeat in range(1, repeats + 1):
        order = cells if repeat % 2 else cells[::-1]
        runs += [dataclasses.replace(cell, repeat=repeat) for cell in order]
    return runs


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
