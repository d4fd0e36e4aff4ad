"""``python -m app.sim --host 127.0.0.1 --port 8100 [--flavor gemini --time-scale 0.01 ...]``.

Every SimConfig field has a flag (``--error-kinds vision,text``); flags override ``SIM_*``.
The control port (``/sim/*`` only, up even while the ``refuse`` outage is on) is
``--control-port`` (0: any free port; the log and ``GET /sim/info`` say which).

``--upstreams FILE`` (TOML or JSON) serves several simulated upstreams from one process,
each on its own ports with its own limits, state and stats::

    [[upstream]]
    name = "openai-org-a"
    port = 8101
    control_port = 8201
    flavor = "openai"
    tpm = 200000

    [[upstream]]
    name = "azure-eastus"
    port = 8102
    flavor = "azure"
    deployments = ["scan=gpt-4o-mini"]

An entry takes ``name``, ``host``, ``port``, ``control_port`` and any SimConfig field; the
fields default to ``SIM_*`` and the flags. JSON: ``{"upstream": [{...}, ...]}`` or a list.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.runtime.serving import uvicorn_config
from app.sim.config import SimConfig, field_kind, field_names, parse_field_text
from app.sim.server import run_simulator

log = logging.getLogger("app.sim")
_PLACE = ("name", "host", "port", "control_port")


@dataclass(frozen=True)
class Upstream:
    """One simulated upstream to serve: where, and with which config."""

    name: str
    host: str
    port: int
    control_port: int
    config: SimConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--control-port", type=int, default=0, help="/sim/* only (default: any free port)")
    parser.add_argument("--upstreams", metavar="FILE", help="serve the upstreams a TOML/JSON file lists")
    defaults = SimConfig()
    for name in field_names():
        value = getattr(defaults, name)
        shown = ",".join(value) if isinstance(value, tuple) else value
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar=field_kind(name).upper(),
            help=f"default {shown!s} (env SIM_{name.upper()})",
        )
    return parser


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> SimConfig:
    config = SimConfig.from_env(environ)
    changes = {
        name: parse_field_text(name, getattr(args, name))
        for name in field_names()
        if getattr(args, name) is not None
    }
    return config.updated(changes)


def read_upstreams(path: Path, base: SimConfig, host: str) -> list[Upstream]:
    """The upstreams ``path`` lists, each entry's SimConfig fields over ``base``."""
    text = path.read_text()
    data: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    entries = data.get("upstream", data.get("upstreams")) if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list of upstreams ([[upstream]] tables)")
    upstreams: list[Upstream] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: upstream {i} is not a table")
        fields = {k: v for k, v in entry.items() if k not in _PLACE}
        try:
            config = base.updated(fields)
        except ValueError as exc:
            raise ValueError(f"{path}: upstream {entry.get('name', i)}: {exc}") from None
        upstreams.append(
            Upstream(
                name=str(entry.get("name", f"upstream-{i}")),
                host=str(entry.get("host", host)),
                port=int(entry.get("port", 0)),
                control_port=int(entry.get("control_port", 0)),
                config=config,
            )
        )
    names = [u.name for u in upstreams]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: upstream names must differ")
    return upstreams


async def serve_upstreams(upstreams: Sequence[Upstream]) -> None:
    """Serve every upstream until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        for upstream in upstreams:
            running = await stack.enter_async_context(
                run_simulator(upstream.config, upstream.host, upstream.port, upstream.control_port)
            )
            log.info(
                "%s: simulated %s upstream at %s (control %s; %s)",
                upstream.name,
                upstream.config.flavor,
                running.base_url,
                running.control_url,
                upstream.config,
            )
        await stop.wait()
        log.info("shutting down")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, dict(os.environ))
        if args.upstreams:
            upstreams = read_upstreams(Path(args.upstreams), config, args.host)
        else:
            upstreams = [Upstream("sim", args.host, args.port, args.control_port, config)]
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    loop_factory = uvicorn_config(None).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_upstreams(upstreams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
