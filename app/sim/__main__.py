"""``python -m app.sim --host 127.0.0.1 --port 8100 [--time-scale 0.01 ...]``.

Every SimConfig field has a flag (``--error-kinds vision,text``); flags override ``SIM_*``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from app.runtime.serving import bind_socket, uvicorn_config
from app.sim.config import SimConfig, field_kind, field_names, parse_field_text
from app.sim.server import create_sim_app

log = logging.getLogger("app.sim")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.sim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    defaults = SimConfig()
    for name in field_names():
        value = getattr(defaults, name)
        shown = ",".join(value) if isinstance(value, tuple) else value
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar=field_kind(name).upper(),
            help=f"default {shown} (env SIM_{name.upper()})",
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


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, dict(os.environ))
    except ValueError as exc:
        parser.error(str(exc))
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    log.info("OpenAI simulator listening on http://%s:%d/v1 (%s)", shown_host, port, config)
    server = uvicorn.Server(uvicorn_config(create_sim_app(config), log_config=uvicorn.config.LOGGING_CONFIG))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
