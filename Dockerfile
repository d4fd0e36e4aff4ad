# ecoscan: one asyncio process. Build: docker build -t ecoscan .
# Run against real services:
#   docker run -p 8000:8000 -e DATABASE_URL=postgresql://... -e OPENAI_API_KEY=sk-... ecoscan
# Without DATABASE_URL / OPENAI_API_KEY it starts the embedded PostgreSQL and the
# OpenAI simulator, as `make run` does (fine for a demo, not for production).
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 ecoscan
WORKDIR /srv/ecoscan

# Dependencies first: this layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml ./
RUN mkdir app && touch app/__init__.py \
    && pip install . \
    && pip uninstall -y ecoscan \
    && rm -rf app

# The code runs from the work directory (uvicorn puts it on sys.path).
COPY --chown=ecoscan:ecoscan app ./app

USER ecoscan
ENV EMBEDDED_PG_DIR=/home/ecoscan/.ecoscan/pgdata
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)" || exit 1
CMD ["uvicorn", "app.main:app", "--http", "app.http_protocol:HttpToolsProtocol", "--host", "0.0.0.0", "--port", "8000", "--no-server-header"]
