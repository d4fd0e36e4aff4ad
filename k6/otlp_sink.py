"""An OTLP/HTTP endpoint that takes every trace export and keeps nothing: what a collector
costs the service to talk to, for k6/cpu_side_by_side.py's traced side (docs/benchmarks.md).

    .venv/bin/python k6/otlp_sink.py --port 4318
"""

from __future__ import annotations

import argparse

from aiohttp import web


async def traces(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
