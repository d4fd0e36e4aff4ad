# ecoscan: one asyncio process. Build: `make image` (docker build -t ecoscan:dev .)
# Run against real services:
#   docker run --stop-timeout 35 -p 8000:8000 \
#     -e DATABASE_URL=postgresql://... -e OPENAI_API_KEY=sk-... ecoscan:dev
# Without DATABASE_URL / OPENAI_API_KEY it starts the embedded PostgreSQL and the
# OpenAI simulator, as `make run` does (fine for a demo, not for production).
#
# BASE_IMAGE: any image with Python 3.11 as `python` (with venv) on PATH and useradd;
# deploy/base-image/build.sh makes one from Debian packages where Docker Hub is out of
# reach. Every stage uses the same base, so the venv's interpreter path holds in the last.
ARG BASE_IMAGE=python:3.11-slim

# The dependency list alone (with the `otel` extra: traces when OTEL_* asks for them), out
# of pyproject.toml: the builder copies this file, so
# its install layer is reused until the dependencies change (not on every edit of
# pyproject.toml's tool sections).
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; \
project = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
deps = project['dependencies'] + project['optional-dependencies']['otel']; \
open('/tmp/requirements.txt', 'w').write(''.join(d + '\n' for d in deps))"

# A venv with the dependencies (wheels only: nothing is compiled, so no build tools),
# their bytecode compiled; pip, setuptools and PostgreSQL's C headers removed.
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install --only-binary=:all: -r /tmp/requirements.txt \
    && /opt/venv/bin/pip uninstall -y pip setuptools \
    && rm -rf /opt/venv/lib/python3.11/site-packages/pgserver/pginstall/include
# The code runs from the work directory (uvicorn puts it on sys.path), compiled here
# because the final image's user cannot write beside it.
WORKDIR /srv/ecoscan
COPY app ./app
RUN /opt/venv/bin/python -m compileall -q --invalidation-mode checked-hash app

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
# postgres refuses to run as root, so the embedded PostgreSQL needs this user too. Its
# data directory's parent exists, owned by it, so a volume mounted there inherits that.
RUN useradd --create-home --uid 10001 ecoscan \
    && install -d -o ecoscan -g ecoscan /home/ecoscan/.ecoscan
COPY --from=builder /opt/venv /opt/venv
WORKDIR /srv/ecoscan
# Owned by root: the service only reads its code.
COPY --from=builder /srv/ecoscan/app ./app

USER ecoscan
# UVICORN_HTTP is uvicorn's --http read from the environment: a command run in the image
# without the flag (`docker run … uvicorn app.main:app`) still bounds request heads while
# reading them and answers malformed HTTP with JSON (app/http/protocol.py).
ENV EMBEDDED_PG_DIR=/home/ecoscan/.ecoscan/pgdata \
    UVICORN_HTTP=app.http.protocol:HttpToolsProtocol
EXPOSE 8000
# SIGTERM drains: scans in flight finish for up to SHUTDOWN_DRAIN_S (25 s), then the
# process exits. `docker stop` waits only 10 s before SIGKILL: give it more with
# `docker run --stop-timeout 35` / `docker stop -t 35` (Kubernetes' default 30 s fits).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
# --timeout-keep-alive: idle connections are kept 75 s (uvicorn's default is 5 s), longer
# than a proxy in front keeps them (ingress-nginx: 60 s), so the proxy always closes an idle
# connection first and never sends a request into one uvicorn is closing (a 502).
# deploy/k8s/base/deployment.yaml repeats this command; tests/test_deploy.py keeps them equal.
CMD ["uvicorn", "app.main:app", "--http", "app.http.protocol:HttpToolsProtocol", "--host", "0.0.0.0", "--port", "8000", "--no-server-header", "--timeout-keep-alive", "75"]
