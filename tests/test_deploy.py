"""deploy/: the compose stack, the Kubernetes manifests and the Grafana dashboard, checked
offline with the real tools where they exist and with schemas always.

- compose.yaml: `docker-compose config` (Debian's docker-compose 1.29, or the docker
  compose v2 plugin when present) and the Compose Specification's JSON schema as vendored
  by check-jsonschema; a misspelt key must fail both. Then what the stack relies on: the
  balancer's settings for SSE, the grace periods against the drain, the settings each
  replica gets (its env file, the wiring, the secrets deploy/make-secrets.sh makes, read
  through `Settings.from_env`, so a misspelt variable fails), images built here rather
  than pulled, the Prometheus and Grafana files. tests/test_compose_up.py brings it up.
- k8s/: the base and each overlay rendered by `kubectl kustomize` (Debian's kubernetes-client
  or any newer kubectl), every object against the Kubernetes schemas kubernetes-validate
  bundles (strict: unknown fields fail; the Prometheus Operator's PodMonitor, whose CRD is
  not among them, by hand), then what keeps production safe (no demo object in the base,
  the demo fenced in its namespace), the drain, keep-alive and connection arithmetic,
  probes, TLS, who may connect, and the references between them.
- the edge (nginx, the Ingress): identity headers dropped, AUTH_MODE=jwt in every kit,
  /readyz and /metrics unrouted, nginx's own errors in the API's JSON, POSTs never
  re-sent, scan tokens out of the access log; Redis with a password, secrets as files,
  the pods' egress.
- the dashboard and the alerts: every PromQL expression parses (promql-parser) and names
  only metrics a running service exports (scraped from /metrics after a scan) with labels
  they carry; promtool unit-tests every alert firing and silent, each links its runbook.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import ipaddress
import json
import re
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import httpx
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import promql_parser
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from app.assembly.services import input_limits
from app.errors import Overloaded
from app.http.head_limits import MAX_REQUEST_HEAD_BYTES
from app.http.protocol import HttpToolsProtocol
from app.main import create_app
from app.runtime.metrics import Metrics
from app.runtime.serving import serve_in_loop
from app.settings import FILE_SETTINGS, Settings, SettingsError, env_name
from app.sim.server import RunningSimulator

from .conftest import data_url, make_jpeg, run_scan, settings_for

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
MAKE_SECRETS = DEPLOY / "make-secrets.sh"
LB_ENTRYPOINT = DEPLOY / "images" / "lb" / "entrypoint.sh"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "ecoscan.yaml"
DASHBOARD = GRAFANA / "dashboards" / "ecoscan.json"
K8S = DEPLOY / "k8s"
K8S_BASE = K8S / "base"
K8S_DEV = K8S / "overlays" / "dev"
K8S_MONITORING = K8S / "monitoring"
K8S_TRACING = K8S / "tracing"
KUSTOMIZATIONS = (K8S_BASE, K8S_DEV, K8S_MONITORING, K8S_TRACING)
DEV_NAMESPACE = "ecoscan-dev"
DOCKERFILE = REPO / "Dockerfile"
# The trace backend's image (Arize Phoenix), its port (OTLP/HTTP and UI) and its user.
PHOENIX_IMAGE = DEPLOY / "images" / "phoenix"
PHOENIX_PORT = 6006
PHOENIX_UID = 10002
# OTLP/HTTP's registered port: Tempo, Jaeger, a Collector, the Datadog Agent.
OTLP_HTTP_PORT = 4318
# The OpenTelemetry SDK's samplers (OTEL_TRACES_SAMPLER), as the specification names them.
OTEL_SAMPLERS = frozenset(
    {
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        "parentbased_traceidratio",
    }
)
# The exemplar label the replicas put on ecoscan_scan_duration_seconds.
EXEMPLAR_TRACE_LABEL = "trace_id"
PROMETHEUS_OPERATOR_API = "monitoring.coreos.com/v1"
# Pods at all times (the autoscaler's minimum).
REPLICAS = 3
# ingress-nginx's upstream-keepalive-timeout (its controller ConfigMap) when not set, s.
INGRESS_NGINX_UPSTREAM_KEEPALIVE_S = 60
# A managed PostgreSQL's usual max_connections, the connections it keeps for superusers
# (superuser_reserved_connections), and room for every other client (migrations by hand,
# psql, backups, monitoring): what the pods may take together is the rest.
MANAGED_POSTGRES_MAX_CONNECTIONS = 100
POSTGRES_RESERVED_CONNECTIONS = 3
OTHER_DATABASE_CLIENTS = 20

# Series Prometheus makes itself for every target, not scraped from it.
PROMETHEUS_SERIES = frozenset({"up"})
# Labels Prometheus attaches to every scraped series (the job and the target).
TARGET_LABELS = frozenset({"instance", "job"})
# What the dashboard must show (issue #12): outcomes, stage wait vs service, budget
# available vs used, 429s, the CPU lane, the event loop, the shared budget.
DASHBOARD_MUST_CHART = frozenset(
    {
        "ecoscan_scans_total",
        "ecoscan_stage_queue_seconds_sum",
        "ecoscan_stage_service_seconds_sum",
        "ecoscan_budget_available",
        "ecoscan_budget_effective_limit_per_minute",
        "ecoscan_upstream_calls_total",
        "ecoscan_upstream_tokens_total",
        "ecoscan_upstream_rate_limited_total",
        "ecoscan_cpu_busy_workers",
        "ecoscan_cpu_queue_depth",
        "ecoscan_event_loop_lag_seconds_bucket",
        "ecoscan_budget_shared",
        "ecoscan_budget_redis_calls_total",
        # ...and what it lacked: scans lost with their process, the reply caches,
        # admission refusals, Redis failures and round trips.
        "ecoscan_scans_lost_total",
        "ecoscan_cache_requests_total",
        "ecoscan_cache_bytes",
        "ecoscan_admission_rejected_total",
        "ecoscan_user_caps_redis_errors_total",
        "ecoscan_scan_stream_mirror_failures_total",
        "ecoscan_budget_redis_call_seconds_bucket",
        # Routing over deployments.
        "ecoscan_upstream_routed_total",
        "ecoscan_upstream_state",
        "ecoscan_upstream_failovers_total",
    }
)
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
# Series alert rules may use from another exporter, with their labels: kube-state-metrics',
# which a Kubernetes Prometheus scrapes (compose's has none: those rules stay silent there).
OTHER_EXPORTERS = {
    "kube_pod_status_ready": frozenset({"namespace", "pod", "uid", "condition"}),
    "kube_deployment_spec_replicas": frozenset({"namespace", "deployment"}),
}
RUNBOOKS = REPO / "docs" / "runbooks.md"
# What the alert rules must watch (issue: alerts that are tested).
ALERTS_MUST_WATCH = frozenset(
    {
        "ecoscan_budget_effective_limit_per_minute",
        "ecoscan_upstream_rate_limited_total",
        "ecoscan_upstream_state",
        "ecoscan_event_loop_lag_seconds_bucket",
        "ecoscan_scans_lost_total",
        "ecoscan_scan_rows_deferred",
        "ecoscan_budget_redis_calls_total",
        "ecoscan_user_caps_redis_errors_total",
        "kube_pod_status_ready",
        # Replicas lost for good, scans' success and first events (their SLOs).
        "up",
        "ecoscan_scans_total",
        "ecoscan_scan_first_event_seconds_bucket",
        "ecoscan_scan_first_event_seconds_count",
    }
)
# Grafana's variables, replaced by something PromQL parses.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h", "instance": ".*"}
# Kubernetes versions the manifests must be valid for (both bundled by kubernetes-validate).
K8S_VERSIONS = ("1.29.0", "1.37.0")
# Time for the process to close its pools etc. after the drain, on top of it.
CLOSE_MARGIN_S = 5.0


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def mutated(text: str, old: str, new: str) -> str:
    """`text` with a deliberate mistake; the mistake must really be made."""
    assert old in text, f"mutation target {old!r} not found"
    return text.replace(old, new)


def seconds(duration: str | int | float) -> float:
    """A compose / nginx duration ("40s", "1m30s", "3600s", "2") in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)?", duration.strip())
    assert parts and "".join(n + u for n, u in parts) == duration.strip(), f"not a duration: {duration!r}"
    return sum(float(n) * units[u or "s"] for n, u in parts)


def size_bytes(size: str) -> int:
    """An nginx size ("14m", "1k", "512") in bytes."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", size.strip())
    assert match, f"not a size: {size!r}"
    return int(match[1]) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match[2].lower()]


def max_body_bytes(settings: Settings) -> int:
    """The largest request body the service accepts with these settings."""
    return input_limits(settings).max_body_bytes


def settings_env_names() -> set[str]:
    """Every environment variable the service reads: Settings' own and uvicorn's."""
    names = {env_name(f.name) for f in dataclasses.fields(Settings) if not f.metadata.get("env_prefix")}
    return names | {f"{env_name(name)}_FILE" for name in FILE_SETTINGS} | {"FORWARDED_ALLOW_IPS"}


# The OpenTelemetry SDK's own variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME,
# the sampler...): the standard names, read by the SDK, not by Settings.
OTEL_PREFIX = "OTEL_"


def settings_from(env: Mapping[str, str], where: str) -> Settings:
    """Settings as the service would read them from `env`; unknown names are mistakes."""
    unknown = {
        k
        for k in env
        if k not in settings_env_names() and not k.startswith("SIM_") and not k.startswith(OTEL_PREFIX)
    }
    assert not unknown, f"{where}: not settings the service reads (misspelt?): {sorted(unknown)}"
    try:
        return Settings.from_env(env)
    except SettingsError as exc:
        pytest.fail(f"{where}: the service would refuse to start: {exc}")


def url_host_port(url: str) -> tuple[str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname, parts.port


# --------------------------------------------------------------------------- compose

_INTERPOLATION = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\})"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution (`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `$$`)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, default = match["name"], match["op"], match["default"] or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _INTERPOLATION.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml as compose runs it with no variables set: every default in force."""
    resolved: dict[str, Any] = interpolate(load_yaml(COMPOSE_FILE), {})
    return resolved


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def compose_command() -> list[str]:
    """The docker compose v2 plugin if present, else Debian's docker-compose."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is None:
        pytest.fail("`docker-compose config` checks deploy/compose.yaml: apt-get install -y docker-compose")
    return [legacy]


def compose_config(compose_file: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """`config -q` on `compose_file`, resolved from deploy/ with no variables from this shell."""
    return subprocess.run(
        [*compose_command(), "--project-directory", str(DEPLOY), "-f", str(compose_file), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home)},
        check=False,
    )


def test_compose_file_passes_docker_compose_config(tmp_path: Path) -> None:
    result = compose_config(COMPOSE_FILE, tmp_path)
    assert result.returncode == 0, result.stderr
    # The same check rejects a broken copy: a misspelt key, an impossible value.
    for old, new in (
        ("stop_grace_period: 40s", "stop_grace_periode: 40s"),
        ("condition: service_healthy", "condition: service_ready"),
        ("replicas: ${ECOSCAN_REPLICAS:-3}", "replicas: three"),
    ):
        broken = tmp_path / "compose.yaml"
        broken.write_text(mutated(COMPOSE_FILE.read_text(), old, new))
        result = compose_config(broken, tmp_path)
        assert result.returncode != 0, f"docker-compose config accepted {new!r}"


def compose_spec_validator() -> Any:
    """The Compose Specification's JSON schema, as check-jsonschema vendors it (offline)."""
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(vendored.read_text())
    return jsonschema.Draft202012Validator(schema)


def schema_errors(document: Any) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in compose_spec_validator().iter_errors(document)
    ]


def test_compose_file_matches_the_compose_specification() -> None:
    raw = load_yaml(COMPOSE_FILE)
    assert schema_errors(raw) == []
    assert schema_errors(interpolate(raw, {})) == []
    text = COMPOSE_FILE.read_text()
    for old, new in (
        ("stop_grace_period: 40s", "stop_grace_periode: 40s"),
        ("condition: service_healthy", "condition: service_ready"),
        ("restart: unless-stopped", "restart: [unless-stopped]"),
    ):
        assert schema_errors(yaml.safe_load(mutated(text, old, new))), f"the schema accepted {new!r}"


def test_compose_stack_has_its_services_wired_together(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"ecoscan", "lb", "postgres", "redis", "prometheus", "phoenix", "grafana"} <= services.keys()
    # Every service reports its health: depends_on and the balancer rely on it.
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no healthcheck"
    # Built here (Dockerfiles on the Debian base) rather than pulled from a registry, but
    # Grafana, which Debian does not package: it is off unless its profile is asked for.
    for name, service in services.items():
        if name == "grafana":
            assert service["profiles"] == ["grafana"]
            continue
        context = (DEPLOY / service["build"]["context"]).resolve()
        assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file(), name
        assert service["build"]["args"]["BASE_IMAGE"] == services["ecoscan"]["build"]["args"]["BASE_IMAGE"]
    app = services["ecoscan"]
    # Replicas: no fixed name, no host port (they would collide), at least two.
    assert "container_name" not in app and "ports" not in app
    assert int(app["deploy"]["replicas"]) >= 2
    assert (DEPLOY / app["build"]["context"]).resolve() == REPO
    assert (REPO / app["build"]["dockerfile"]).is_file()
    assert "8000" in [str(p) for p in app["expose"]]
    assert any("/readyz" in str(part) for part in app["healthcheck"]["test"])
    for dependency in ("postgres", "redis"):
        assert app["depends_on"][dependency]["condition"] == "service_healthy"
        assert services[dependency]["healthcheck"]["test"]
    # Tracing is not a dependency: a replica serves whether its exports arrive or not.
    assert app["depends_on"].keys() == {"postgres", "redis"}
    assert services["lb"]["depends_on"]["ecoscan"]["condition"] == "service_healthy"
    # Every bind-mounted file is in the repository.
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The secret files, as deploy/make-secrets.sh makes them (in a directory of the test's)."""
    directory = tmp_path_factory.mktemp("secrets")
    subprocess.run(
        [str(MAKE_SECRETS), str(directory)],
        check=True,
        capture_output=True,
        timeout=30,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},  # no OPENAI_API_KEY: the simulator
    )
    return directory


def env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines; blank lines and `#` lines skipped (as compose reads env files)."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def replica_environment(compose: dict[str, Any], secrets: Path) -> dict[str, str]:
    """What a replica's process finds in its environment: the env files, then
    `environment` (which wins), with /run/secrets/<name> pointed at the secret's file."""
    app = compose["services"]["ecoscan"]
    env: dict[str, str] = {}
    for name in app["env_file"]:
        env.update(env_file(DEPLOY / name))
    env.update(environment(app))
    mounted = {f"/run/secrets/{name}": secrets / name for name in app["secrets"]}
    for name, value in env.items():
        if name.endswith("_FILE"):
            assert value in mounted, f"{name}={value}: not a secret the replicas mount"
            env[name] = str(mounted[value])
    return env


def test_each_replica_gets_settings_the_service_accepts(compose: dict[str, Any], secrets_dir: Path) -> None:
    services = compose["services"]
    env = replica_environment(compose, secrets_dir)
    settings = settings_from(env, "compose.yaml, services.ecoscan (env_file + environment)")
    assert settings.uses_simulator, "with an empty openai_api_key the stack runs the simulator"
    assert settings.database_url is not None and settings.redis_url is not None
    assert url_host_port(settings.database_url) == ("postgres", 5432)
    assert url_host_port(settings.redis_url)[0] == "redis"
    # The database's URL and the server agree: the user and database it is created with,
    # and the password it is initialised with (deploy/make-secrets.sh writes both files).
    database_env = environment(services["postgres"])
    assert database_env["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert "postgres_password" in services["postgres"]["secrets"]
    db_url = urllib.parse.urlsplit(settings.database_url)
    assert (db_url.username, db_url.password, db_url.path) == (
        database_env["POSTGRES_USER"],
        (secrets_dir / "postgres_password").read_text().strip(),
        "/" + database_env["POSTGRES_DB"],
    )
    assert settings.redis_prefix
    # Redis asks for a password, the one in the replicas' redis_url: both files from
    # deploy/make-secrets.sh, the server's read from its secret file, in protected mode.
    redis_password = (secrets_dir / "redis_password").read_text().strip()
    assert len(redis_password) >= 32
    assert urllib.parse.urlsplit(settings.redis_url).password == redis_password
    assert "redis_password" in services["redis"]["secrets"]
    (script,) = [part for part in services["redis"]["command"] if "redis-server" in part]
    assert "--protected-mode yes" in script
    assert "requirepass $(cat /run/secrets/redis_password)" in script  # $$ in the file
    assert "redis_password" in " ".join(services["redis"]["healthcheck"]["test"])
    # The default models' Tier 1 limits (docs/configuration.md, "Models"): gpt-4o-mini has 200k TPM.
    assert (settings.vision_model, settings.answer_model) == ("gpt-4o-mini", "gpt-4o-mini")
    assert (settings.openai_rpm, settings.openai_tpm) == (500, 200_000)
    # PostgreSQL takes every replica's pool (and its LISTEN connection) with room to scale.
    command = services["postgres"]["command"]
    max_connections = int(command[command.index("-c") + 1].split("=", 1)[1])
    assert max_connections >= 10 * (fixed_pool(settings) + 1)


def test_no_secret_is_in_any_environment(compose: dict[str, Any], secrets_dir: Path) -> None:
    """Secrets reach the services as files (compose secrets), never as values."""
    secret_values = {path.read_text().strip() for path in secrets_dir.iterdir()} - {""}
    secret_names = {"DATABASE_URL", "REDIS_URL", "OPENAI_API_KEY", "AUTH_JWT_SECRET", "POSTGRES_PASSWORD"}
    for name, service in compose["services"].items():
        env = environment(service)
        if name == "ecoscan":
            env = {**env_file(DEPLOY / service["env_file"][0]), **env}
        assert not secret_names & env.keys(), f"{name}: {sorted(secret_names & env.keys())}"
        assert not [k for k in env if "PASSWORD" in k and not k.endswith("FILE")], name
        assert not secret_values & set(env.values()), name
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"], f"{name} mounts an undeclared secret {secret}"
    # deploy/make-secrets.sh makes every secret compose.yaml declares, and nothing in git.
    for secret in compose["secrets"].values():
        assert Path(secret["file"]).name in {p.name for p in secrets_dir.iterdir()}
        assert Path(secret["file"]).parent == Path("./secrets")
    assert "deploy/secrets/" in (REPO / ".gitignore").read_text().splitlines()


def test_replicas_believe_bearer_tokens_not_headers(compose: dict[str, Any], secrets_dir: Path) -> None:
    """The kit's identity: AUTH_MODE=jwt with the mounted HS256 secret, never gateway (which
    believes X-User-ID as sent); anonymous callers keyed by the address the balancer
    alone may vouch for."""
    env = replica_environment(compose, secrets_dir)
    settings = settings_from(env, "compose.yaml, services.ecoscan (env_file + environment)")
    assert settings.auth_mode == "jwt"
    assert settings.auth_jwt_secret == (secrets_dir / "auth_jwt_secret").read_text().strip()
    assert "auth_jwt_secret" in compose["services"]["ecoscan"]["secrets"]
    # Anonymous callers are allowed (the page), so their key, the client's address, must be
    # the balancer's X-Forwarded-For and nobody else's.
    assert settings.auth_allow_anonymous is True
    # Rotating identities must not buy more scans: a rate and a daily quota per caller.
    assert settings.user_scan_rate_per_min > 0 and settings.user_daily_scan_quota > 0
    assert env["FORWARDED_ALLOW_IPS"] == compose["services"]["lb"]["networks"]["default"]["ipv4_address"]
    assert "X-Forwarded-For $remote_addr" in nginx_directives()["proxy_set_header"]


def test_the_network_and_the_balancers_address(compose: dict[str, Any], secrets_dir: Path) -> None:
    services = compose["services"]
    # Published on this machine only unless asked: plain HTTP carries bearer tokens.
    (published,) = services["lb"]["ports"]
    assert published == "127.0.0.1:8080:80", published
    env = replica_environment(compose, secrets_dir)
    # Only the balancer's X-Forwarded-For is believed, and its address is fixed: in the
    # network's subnet, outside the range other containers' addresses come from.
    lb_address = ipaddress.ip_address(services["lb"]["networks"]["default"]["ipv4_address"])
    assert env["FORWARDED_ALLOW_IPS"] == str(lb_address)
    (pool,) = compose["networks"]["default"]["ipam"]["config"]
    subnet = ipaddress.ip_network(pool["subnet"])
    assert lb_address in subnet
    assert lb_address not in ipaddress.ip_network(pool["ip_range"])
    # Away from the ranges such networks usually meet: Docker's own pools, the AWS default
    # VPC, GCP's auto-mode range, Kubernetes' and Podman's defaults.
    for busy in (
        "172.16.0.0/12",
        "192.168.0.0/16",
        "10.128.0.0/9",
        "10.42.0.0/15",
        "10.96.0.0/12",
        "10.244.0.0/16",
        "10.88.0.0/15",
    ):
        assert not subnet.overlaps(ipaddress.ip_network(busy)), f"{subnet} overlaps {busy}"


def test_compose_grace_periods_fit_the_drain(compose: dict[str, Any], secrets_dir: Path) -> None:
    services = compose["services"]
    drain = settings_from(replica_environment(compose, secrets_dir), "compose.yaml").shutdown_drain_s
    assert seconds(services["ecoscan"]["stop_grace_period"]) >= drain + CLOSE_MARGIN_S
    # The balancer's graceful stop lets streams end, but within its own grace.
    worker_shutdown = seconds(nginx_directives()["worker_shutdown_timeout"][0])
    assert worker_shutdown < seconds(services["lb"]["stop_grace_period"])


# --------------------------------------------------------------------------- nginx


def nginx_directives() -> dict[str, list[str]]:
    """Every `name value;` in nginx.conf (comments dropped), values in file order."""
    found: dict[str, list[str]] = {}
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    for match in re.finditer(r"(?m)^\s*([a-z_0-9]+)\s+([^;{}]*?)\s*;", text):
        found.setdefault(match[1], []).append(match[2])
    return found


def nginx_block(name: str) -> str:
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    match = re.search(re.escape(name) + r"\s*\{(?P<body>[^{}]*)\}", text)
    assert match, f"no `{name} {{ }}` block in nginx.conf"
    return match["body"]


def test_load_balancer_is_configured_for_sse(compose: dict[str, Any]) -> None:
    d = nginx_directives()
    assert d["proxy_buffering"] == ["off"]
    assert d["proxy_cache"] == ["off"]
    assert seconds(d["proxy_read_timeout"][0]) >= 3600
    assert seconds(d["proxy_send_timeout"][0]) >= 3600
    # HTTP/1.1 with keep-alive to the replicas...
    assert d["proxy_http_version"] == ["1.1"]
    assert 'Connection ""' in d["proxy_set_header"]
    upstream = nginx_block("upstream ecoscan")
    assert re.search(r"\bkeepalive\s+\d+;", upstream)
    # ...closed by nginx before the replicas' uvicorn (the image's command) closes them
    # under a request.
    keepalive_timeout = re.search(r"\bkeepalive_timeout\s+(\S+);", upstream)
    assert keepalive_timeout
    assert "command" not in compose["services"]["ecoscan"], "the replicas run the image's command"
    uvicorn_idle = uvicorn_options(dockerfile_command())["timeout_keep_alive"]
    assert seconds(keepalive_timeout[1]) < uvicorn_idle
    # Every replica of the compose service: the name resolves to all of them when nginx
    # loads its configuration, and the image's entrypoint reloads nginx when that set of
    # addresses changes (Debian's nginx 1.22 has no `server ... resolve`).
    server = re.search(r"\bserver\s+([^\s:;]+):(\d+)([^;]*);", upstream)
    assert server and server[1] in compose["services"] and server[2] == "8000"
    assert "resolve" not in server[3].split()
    entrypoint = LB_ENTRYPOINT.read_text()
    assert f'name="${{UPSTREAM_NAME:-{server[1]}}}"' in entrypoint
    assert 'getent ahostsv4 "$name"' in entrypoint and "nginx -s reload" in entrypoint
    assert compose["services"]["lb"]["build"]["context"] == "./images/lb"
    # The client's address for the per-user caps of anonymous scans.
    assert "X-Forwarded-For $remote_addr" in d["proxy_set_header"]


def test_load_balancer_takes_the_largest_body_and_retries_only_what_never_started() -> None:
    d = nginx_directives()
    limit = size_bytes(d["client_max_body_size"][0])
    largest = max_body_bytes(Settings())
    # The service answers oversized bodies itself (JSON 413): nginx must let them through.
    assert largest <= limit <= 2 * largest
    (retried_on,) = [value.split() for value in d["proxy_next_upstream"]]
    assert {"error", "http_503"} <= set(retried_on)
    # A POST sent to a replica may have started a scan there: passed on only when it
    # never reached one (nginx's default for non-idempotent methods).
    assert "non_idempotent" not in retried_on
    assert not {"http_500", "http_502", "http_504", "http_429"} & set(retried_on)
    assert 2 <= int(d["proxy_next_upstream_tries"][0]) <= 3
    # A request retried elsewhere must be whole: nginx buffers it before passing it on.
    assert d.get("proxy_request_buffering", ["on"]) == ["on"]
    assert "max_fails=0" in nginx_block("upstream ecoscan")


def public_server() -> str:
    """The text of nginx.conf's public `server { listen 80; ... }` block (nested blocks too)."""
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    start = text.index("listen 80;")
    depth, end = 1, start
    while depth:
        end += 1
        depth += {"{": 1, "}": -1}.get(text[end], 0)
    return text[start:end]


def nginx_location(server: str, name: str) -> str:
    # The block ends at a line holding only its `}` (a JSON body's braces are inside quotes).
    match = re.search(r"location\s+" + re.escape(name) + r"\s*\{(?P<body>.*?)^\s*\}\s*$", server, re.M | re.S)
    assert match, f"no `location {name}` in the public server"
    return match["body"]


def test_balancer_drops_identity_headers_a_client_sends() -> None:
    """An empty proxy_set_header value removes the header: whatever a client puts in
    X-User-ID or X-Gateway-Secret never reaches a replica (tests/test_compose_up.py
    checks it through the running stack)."""
    proxied = nginx_location(public_server(), "/")
    assert re.search(r'proxy_set_header\s+X-User-ID\s+"";', proxied)
    assert re.search(r'proxy_set_header\s+X-Gateway-Secret\s+"";', proxied)


def test_balancer_routes_neither_readiness_nor_metrics() -> None:
    server = public_server()
    for private in ("/readyz", "/metrics"):
        body = nginx_location(server, "= " + private)
        assert "proxy_pass" not in body and re.search(r"return\s+404\s+'\{", body), private
    # The balancer's own health check reads /readyz on loopback only.
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    assert re.search(r"listen\s+127\.0\.0\.1:8081;", text)
    assert "http://127.0.0.1:8081/readyz" in " ".join(compose_lb_healthcheck())


def compose_lb_healthcheck() -> list[str]:
    test: list[str] = load_yaml(COMPOSE_FILE)["services"]["lb"]["healthcheck"]["test"]
    return test


def test_balancer_errors_are_the_apis_json_with_retry_after() -> None:
    """nginx's own 502/503/504 (no replica, or none in time), 400, 408, 413 and 414 answer like the
    service: JSON {"detail", "code"}, with codes docs/api.md lists, and Retry-After on the
    retryable ones."""
    server = public_server()
    api = (REPO / "docs" / "api.md").read_text()
    pages = {
        status: location
        for statuses, location in re.findall(r"error_page\s+([\d\s]+?)\s+=?\s*(@\w+);", server)
        for status in statuses.split()
    }
    assert set(pages) == {"400", "408", "413", "414", "494", "502", "503", "504"}, pages
    # nginx's 494 (a header line over its buffers) and 414 (a request line over them) are
    # the service's 431.
    sent_as = {"494": "431", "414": "431"}
    for status, location in pages.items():
        body = nginx_location(server, location)
        assert "default_type application/json;" in body
        match = re.search(r"return\s+(\d+)\s+'(?P<json>[^']*)';", body)
        assert match and match[1] == sent_as.get(status, status), body
        answer = json.loads(match["json"])
        assert set(answer) == {"detail", "code"}, answer
        row = f"| {match[1]} | `{answer['code']}` |"
        assert row in api, f"{answer['code']} ({match[1]}) not in docs/api.md"
        retryable = status.startswith("5")
        assert bool(re.search(r"add_header\s+Retry-After\s+\d+\s+always;", body)) == retryable, location
    # The longest header line nginx takes is the service's whole head limit.
    (buffers,) = nginx_directives()["large_client_header_buffers"]
    assert size_bytes(buffers.split()[1]) == MAX_REQUEST_HEAD_BYTES


def test_balancer_log_keeps_scan_tokens_out() -> None:
    """The access log records the path and the query, but a query carrying a scan's
    capability token (`?token=`, any case, or its name percent-escaped) as [redacted]."""
    directives = nginx_directives()
    (log_format,) = directives["log_format"]
    assert "$request " not in log_format + " " and "$request_uri" not in log_format
    assert "$args " not in log_format + " " and "$query_string" not in log_format
    assert "$http_" not in log_format  # no header: X-Scan-Token, Authorization, Referer
    text = re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())
    match = re.search(r"map\s+\$args\s+\$args_for_log\s*\{(?P<body>[^}]*)\}", text)
    assert match and "$args_for_log" in log_format
    (pattern,) = re.findall(r'"~\*([^"]+)"\s+"\[redacted\]";', match["body"])
    scrub = re.compile(pattern, re.IGNORECASE)
    for query in ("token=abc", "after=3&token=abc", "TOKEN=abc", "%74oken=abc", "a=1&to%6Ben=x"):
        assert scrub.search(query), query
    for query in ("after=3", "limit=10&after=2", ""):
        assert not scrub.search(query), query


# --------------------------------------------------------------------------- prometheus / grafana


def test_prometheus_scrapes_every_replica(compose: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "ecoscan"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (discovery,) = job["dns_sd_configs"]
    assert discovery["type"] == "A" and discovery["port"] == 8000
    assert discovery["names"] == ["ecoscan"] and "ecoscan" in compose["services"]
    assert seconds(discovery["refresh_interval"]) <= 30
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(
        str(m).startswith("./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml") for m in mounts
    )
    # The rule files it names, beside it in the container as they are beside it here.
    for rules in config.get("rule_files", []):
        assert f"./prometheus/{rules}:/etc/prometheus/{rules}:ro" in mounts, rules


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool checks the alert rules: apt-get install -y --no-install-recommends prometheus")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, check=False)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [
        (parts[0].upper(), parts[1] if len(parts) > 1 else "")
        for line in joined.splitlines()
        if (parts := line.strip().split(None, 1))
    ]


def test_compose_ships_a_trace_backend_the_replicas_export_to(
    compose: dict[str, Any], secrets_dir: Path
) -> None:
    """Phoenix, built here from pinned PyPI wheels like the other images from Debian's, is
    where every replica's OTLP exporter sends (deploy/ecoscan.env, so a copy of it can point
    elsewhere), published on this machine only (its UI has no login)."""
    services = compose["services"]
    phoenix = services["phoenix"]
    assert phoenix["image"] == "ecoscan-phoenix:local"
    (published,) = phoenix["ports"]
    assert published == f"127.0.0.1:{PHOENIX_PORT}:{PHOENIX_PORT}", published
    assert "phoenix-data:/var/lib/phoenix" in phoenix["volumes"] and "phoenix-data" in compose["volumes"]
    assert any(f"127.0.0.1:{PHOENIX_PORT}/readyz" in part for part in phoenix["healthcheck"]["test"])
    env = replica_environment(compose, secrets_dir)
    settings_from(env, "compose.yaml, services.ecoscan (env_file + environment)")
    assert url_host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"]) == ("phoenix", PHOENIX_PORT)
    assert not any(name.startswith(OTEL_PREFIX) for name in environment(services["ecoscan"]))
    assert env["OTEL_SERVICE_NAME"] == "ecoscan"
    assert env["OTEL_TRACES_SAMPLER"] in OTEL_SAMPLERS
    assert 0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1
    assert "openinference.project.name=ecoscan" in env["OTEL_RESOURCE_ATTRIBUTES"].split(",")

    # The image: every package pinned, wheels only; the final stage runs as its own user,
    # with its data in the volume compose mounts, and reports its health.
    pins = [line for line in (PHOENIX_IMAGE / "requirements.txt").read_text().splitlines() if line]
    pins = [line for line in pins if not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line) for line in pins), pins
    assert any(line.startswith("arize-phoenix==") for line in pins)
    instructions = dockerfile_instructions(PHOENIX_IMAGE / "Dockerfile")
    runs = " ".join(args for name, args in instructions if name == "RUN")
    assert "--only-binary=:all: -r /tmp/requirements.txt" in runs
    final = instructions[max(i for i, (name, _) in enumerate(instructions) if name == "FROM") :]
    last = {name: args for name, args in final}
    assert last["USER"] == str(PHOENIX_UID)
    assert last["VOLUME"] == "/var/lib/phoenix" and f"PHOENIX_WORKING_DIR={last['VOLUME']}" in last["ENV"]
    assert f"PHOENIX_PORT={PHOENIX_PORT}" in last["ENV"] and str(PHOENIX_PORT) in last["EXPOSE"].split()
    assert "/readyz" in last["HEALTHCHECK"]
    # Nothing fetched from the internet at run time: the stack may have none.
    assert "PHOENIX_ALLOW_EXTERNAL_RESOURCES=false" in last["ENV"]
    assert "PHOENIX_TELEMETRY_ENABLED=false" in last["ENV"]


def test_prometheus_keeps_the_exemplars(compose: dict[str, Any]) -> None:
    """Exemplars come only in the OpenMetrics format, which Prometheus asks for first unless
    a job's scrape_protocols says otherwise, and are kept only with exemplar storage on."""
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
    for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]:
        assert job.get("scrape_protocols", ["OpenMetricsText1.0.0"])[0].startswith("OpenMetrics"), job


def test_grafana_links_a_scans_exemplar_to_its_trace(compose: dict[str, Any]) -> None:
    """The scan-duration panel shows exemplars, and the datasource makes each one's
    trace_id a link to that trace in Phoenix, at the address the browser reaches it on."""
    (destination,) = provisioned_datasource()["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == EXEMPLAR_TRACE_LABEL
    # Grafana expands ${PHOENIX_UI_URL} from its environment, and $$ to $.
    assert destination["url"] == "${PHOENIX_UI_URL}/redirects/traces/$${__value.raw}"
    assert "datasourceUid" not in destination  # a URL, not a Grafana datasource
    ui = environment(compose["services"]["grafana"])["PHOENIX_UI_URL"]
    (published,) = compose["services"]["phoenix"]["ports"]
    assert ui == "http://" + published.rsplit(":", 1)[0]
    with_exemplars = [
        (panel["title"], target["expr"])
        for panel in panels()
        for target in panel.get("targets", [])
        if target.get("exemplar")
    ]
    assert with_exemplars, "no panel shows exemplars"
    for title, expr in with_exemplars:
        names = {selector_name(s) for s in selectors(promql_parser.parse(grafana_expr(expr)))}
        assert names == {"ecoscan_scan_duration_seconds_bucket"}, (title, expr)


def test_prometheus_loads_the_alert_rules() -> None:
    """prometheus.yml names alerts.yml (beside it, as compose mounts the config), and
    `promtool check config` follows it there."""
    config = load_yaml(PROMETHEUS_CONFIG)
    assert [(PROMETHEUS_CONFIG.parent / f).resolve() for f in config["rule_files"]] == [ALERTS.resolve()]
    result = run_promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    check = run_promtool("check", "rules", str(ALERTS))
    assert check.returncode == 0, check.stdout + check.stderr
    tests = run_promtool("test", "rules", str(ALERTS_TESTS))
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_alert_unit_tests_fail_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests bite: a threshold moved, and the alert no longer fires where they say."""
    shutil.copy(ALERTS_TESTS, tmp_path / ALERTS_TESTS.name)
    (tmp_path / ALERTS.name).write_text(mutated(ALERTS.read_text(), "> 0.1\n", "> 0.5\n"))
    result = run_promtool("test", "rules", str(tmp_path / ALERTS_TESTS.name))
    assert result.returncode != 0 and "EcoscanEventLoopLagHigh" in result.stdout + result.stderr


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"] if "alert" in rule]


def test_every_alert_is_tested_firing_and_silent() -> None:
    rules = alert_rules()
    alerts = {rule["alert"] for rule in rules}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description", "runbook_url"} <= rule["annotations"].keys(), rule["alert"]
    fired: set[str] = set()
    silent: set[str] = set()
    for case in load_yaml(ALERTS_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts <= fired, f"never seen firing: {sorted(alerts - fired)}"
    assert alerts <= silent, f"never seen silent: {sorted(alerts - silent)}"
    assert fired | silent <= alerts, f"tests of no rule: {sorted((fired | silent) - alerts)}"


def markdown_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped,
    spaces to dashes)."""
    headings = re.findall(r"(?m)^#{1,6}\s+(.+?)\s*$", text)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_links_its_runbook() -> None:
    """runbook_url is docs/runbooks.md#<the alert's section>, and that section says what
    it means, what to check and what to do."""
    text = RUNBOOKS.read_text()
    anchors = markdown_anchors(text)
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/runbooks.md" and anchor in anchors, rule["alert"]
        assert anchor == rule["alert"].lower(), rule["alert"]
        section = text.split(f"## {rule['alert']}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**What it means.**", "**What to check.**", "**What to do.**"):
            assert part in section, f"{rule['alert']}: no {part}"


def provisioned_datasource() -> dict[str, Any]:
    (datasource,) = load_yaml(DATASOURCES)["datasources"]
    assert isinstance(datasource, dict)
    return datasource


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> Iterator[dict[str, Any]]:
    for panel in dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def datasource_refs(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_refs(item)


def test_grafana_provisioning_loads_the_dashboard(compose: dict[str, Any]) -> None:
    datasource = provisioned_datasource()
    assert datasource["type"] == "prometheus"
    host, port = url_host_port(datasource["url"])
    assert host == "prometheus" and host in compose["services"] and port == 9090
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    grafana = compose["services"]["grafana"]
    mounts = dict(str(m).split(":")[:2] for m in grafana["volumes"] if str(m).startswith("."))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


def test_dashboard_refers_to_the_provisioned_datasource() -> None:
    uid = provisioned_datasource()["uid"]
    refs = list(datasource_refs(dashboard()))
    assert refs, "the dashboard names no datasource"
    for ref in refs:
        assert ref == {"type": "prometheus", "uid": uid}, ref
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels():
        if panel["type"] != "row":
            assert panel["targets"] and all(t.get("expr") for t in panel["targets"]), panel["title"]


# --------------------------------------------------------------------------- the dashboard's queries


def alert_queries() -> Iterator[tuple[str, str]]:
    """(alert name, PromQL) for every rule in alerts.yml."""
    for group in load_yaml(ALERTS)["groups"]:
        for rule in group["rules"]:
            yield f"{group['name']}/{rule.get('alert') or rule.get('record')}", rule["expr"]


def grafana_expr(expr: str) -> str:
    """A target's PromQL with Grafana's variables replaced by values."""

    def grafana_variable(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        assert name in GRAFANA_VARIABLES, f"unknown Grafana variable ${name}"
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", grafana_variable, expr)


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query; Grafana's variables replaced by values."""
    for panel in panels():
        for target in panel.get("targets", []):
            yield panel["title"], grafana_expr(target["expr"])


Node = TypeVar("Node", bound=promql_parser.Expr)


def nodes_of(expr: promql_parser.Expr, kind: type[Node]) -> list[Node]:
    found: list[Node] = []

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, kind):
            found.append(node)
        return True

    promql_parser.walk(expr, visit)
    return found


def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    return nodes_of(expr, promql_parser.VectorSelector)


def aggregations(expr: promql_parser.Expr) -> list[promql_parser.AggregateExpr]:
    return nodes_of(expr, promql_parser.AggregateExpr)


def selector_name(selector: promql_parser.VectorSelector) -> str:
    if selector.name:
        return selector.name
    names = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    assert len(names) == 1, f"a selector without one metric name: {selector}"
    return names[0]


SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}


def exported_series(exposition: str, metrics: Metrics) -> dict[str, set[str]]:
    """Every series name /metrics declares -> its label names. A labelled metric with no
    sample yet is declared (HELP/TYPE) with no sample to show its labels: those come from
    the Metrics object's declaration."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for suffix in SUFFIXES[family.type]:
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    for declared in vars(metrics).values():
        if isinstance(declared, MetricWrapperBase):
            for suffix in SUFFIXES.get(declared._type or "", ()):
                name = declared._name + suffix
                if name in series:
                    series[name].update(declared._labelnames, ["le"] if suffix == "_bucket" else [])
    return series


@pytest.fixture
async def exposition(database_url: str, sim: RunningSimulator) -> tuple[str, Metrics]:
    """/metrics of a running service (process metrics included, as in production) after
    one scan, so that every histogram the pipeline observes has samples."""
    metrics = Metrics()
    app = create_app(settings_for(database_url, sim), metrics=metrics)
    async with (
        serve_in_loop(app, lifespan="on", http=HttpToolsProtocol) as url,
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0)) as client,
    ):
        outcome = await run_scan(client, json={"image_url": data_url(make_jpeg(12))})
        assert outcome.status == 200 and outcome.terminal.event == "done", outcome.body
        response = await client.get("/metrics")
        assert response.status_code == 200
        return response.text, metrics


def query_problems(
    where: str, query: str, series: Mapping[str, set[str] | frozenset[str]], named: set[str]
) -> list[str]:
    """What is wrong with one PromQL query against the exported series (-> label names): it
    does not parse, names a series nobody exports, or a label the series do not carry
    (in a selector, `by (...)` or `on (...)`). Adds every series it names to `named`."""
    try:
        expr = promql_parser.parse(query)
    except Exception as exc:  # the parser raises a plain ValueError-like error
        return [f"{where}: {query!r} is not PromQL: {exc}"]
    problems = []
    for selector in selectors(expr):
        name = selector_name(selector)
        named.add(name)
        if name in PROMETHEUS_SERIES:
            continue
        if name not in series:
            problems.append(f"{where}: {name} is not exported")
            continue
        labels = {m.name for m in selector.matchers.matchers} - {"__name__"}
        unknown = labels - series[name] - TARGET_LABELS
        if unknown:
            problems.append(f"{where}: {name} has no label {sorted(unknown)}")

    # Labels the query makes itself (label_replace's and label_join's destination).
    made = {
        call.args[1].val
        for call in nodes_of(expr, promql_parser.Call)
        if call.func.name in ("label_replace", "label_join")
    }

    def available(node: promql_parser.Expr) -> set[str]:
        exported = (series.get(selector_name(s), set()) for s in selectors(node))
        return set(TARGET_LABELS).union(made, *exported)

    for aggregation in aggregations(expr):
        if aggregation.modifier is None or aggregation.modifier.type != promql_parser.AggModifierType.By:
            continue
        unknown = set(aggregation.modifier.labels) - available(aggregation.expr)
        if unknown:
            names = [selector_name(s) for s in selectors(aggregation.expr)]
            problems.append(f"{where}: `by ({', '.join(sorted(unknown))})` over {names}: no such label")
    for binary in nodes_of(expr, promql_parser.BinaryExpr):
        matching = binary.modifier.matching if binary.modifier else None
        if matching is not None and matching.type == promql_parser.LabelModifierType.Include:
            for side in (binary.lhs, binary.rhs):
                unknown = set(matching.labels) - available(side)
                if unknown:
                    problems.append(f"{where}: `on ({', '.join(sorted(unknown))})`: no such label")
    return problems


async def test_dashboard_charts_only_metrics_the_service_exports(exposition: tuple[str, Metrics]) -> None:
    series = exported_series(*exposition)
    charted: set[str] = set()
    problems: list[str] = []
    for title, query in dashboard_queries():
        problems += query_problems(title, query, series, charted)
    assert not problems, "\n".join(problems)
    assert not DASHBOARD_MUST_CHART - charted, sorted(DASHBOARD_MUST_CHART - charted)
    # The replica picker's values come from an exported metric too.
    (variable,) = dashboard()["templating"]["list"]
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    match = re.fullmatch(r"label_values\((\w+),\s*instance\)", query)
    assert match and match[1] in series, query


async def test_alert_rules_watch_only_metrics_the_service_exports(exposition: tuple[str, Metrics]) -> None:
    series: dict[str, set[str] | frozenset[str]] = {**exported_series(*exposition), **OTHER_EXPORTERS}
    # What the recording rules make (each a sum over every replica: no labels).
    recorded = [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"] if "record" in rule]
    series.update({rule["record"]: frozenset() for rule in recorded})
    watched: set[str] = set()
    problems: list[str] = []
    for name, query in alert_queries():
        problems += query_problems(name, query, series, watched)
    assert not problems, "\n".join(problems)
    assert not ALERTS_MUST_WATCH - watched, sorted(ALERTS_MUST_WATCH - watched)


def test_refused_panel_counts_only_refusals_for_capacity() -> None:
    """The overview's "Refused" counted every rejected request (400s, 413s...); it counts the
    429/503 refusals for capacity: exactly the codes of `Overloaded` (app/errors.py)."""
    (panel,) = [p for p in panels() if p["title"].startswith("Refused")]
    (target,) = panel["targets"]
    match = re.search(r'outcome="rejected",code=~"([A-Z_|]+)"', target["expr"])
    assert match, target["expr"]

    def codes(cls: type[Overloaded]) -> set[str]:
        return {cls.code}.union(*(codes(sub) for sub in cls.__subclasses__()))

    assert set(match[1].split("|")) == codes(Overloaded)
    titles = [p["title"] for p in panels()]
    assert len(titles) == len(set(titles)), "two panels share a title"


def test_dashboard_queries_follow_the_replica_picker() -> None:
    """Every selector honours $instance; panels titled per replica split by instance."""
    for title, query in dashboard_queries():
        expr = promql_parser.parse(query)
        for selector in selectors(expr):
            assert any(m.name == "instance" for m in selector.matchers.matchers), f"{title}: {query}"
        if "per replica" in title:
            grouped = [a for a in aggregations(expr) if a.modifier and "instance" in a.modifier.labels]
            assert grouped, f"{title}: {query} is not split by instance"


# --------------------------------------------------------------------------- kubernetes


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("`kubectl kustomize` renders deploy/k8s: apt-get install -y kubernetes-client")
    return found


@functools.cache
def _rendered(directory: Path) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {directory.relative_to(REPO)}: {result.stderr}"
    return result.stdout


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize` makes of a kustomization (fresh copies)."""
    found = [doc for doc in yaml.safe_load_all(_rendered(directory)) if doc]
    assert found, f"{directory.relative_to(REPO)} renders nothing"
    return found


def objects(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """A kustomization's objects by (kind, name)."""
    found = {(doc["kind"], doc["metadata"]["name"]): doc for doc in kustomize(directory)}
    assert len(found) == len(kustomize(directory)), "two objects of one kind share a name"
    return found


def validate_k8s(document: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"no schema to check {document.get('kind')} {document.get('apiVersion')}: {exc.message}")


def k8s_errors(document: dict[str, Any], version: str) -> str | None:
    try:
        validate_k8s(document, version)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda d: str(d.relative_to(K8S)))
def test_k8s_kustomizations_render_objects_the_kubernetes_schemas_accept(
    kustomization: Path, version: str
) -> None:
    """Every object the base and each overlay make, as `kubectl kustomize` makes it, against
    the API schemas (strict). The Prometheus Operator's objects are not in them: their shape
    is checked by hand (test_k8s_pod_monitor_scrapes_every_pod)."""
    errors = []
    for document in kustomize(kustomization):
        if document["apiVersion"] == PROMETHEUS_OPERATOR_API:
            assert document["kind"] == "PodMonitor", document["kind"]
            continue
        error = k8s_errors(document, version)
        if error:
            errors.append(f"{document['kind']}/{document['metadata']['name']}: {error}")
    assert not errors, "\n".join(errors)


def test_k8s_schema_check_rejects_broken_manifests() -> None:
    text = (K8S_BASE / "deployment.yaml").read_text()
    for old, new in (
        ("readinessProbe:", "readinesProbe:"),
        ("terminationGracePeriodSeconds: 45", "terminationGracePeriodSeconds: soon"),
        ("maxUnavailable: 0", "maxUnavailable: [0]"),
        ("secretName: ecoscan-secrets", "secretname: ecoscan-secrets"),
    ):
        assert k8s_errors(yaml.safe_load(mutated(text, old, new)), K8S_VERSIONS[-1]), f"accepted {new!r}"


def test_k8s_kustomize_rejects_a_missing_file(tmp_path: Path) -> None:
    """The render is real: a kustomization naming a file that is not there fails."""
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "k8s" / "base" / "pdb.yaml").unlink()
    result = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path / "k8s" / "overlays" / "dev")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "pdb.yaml" in result.stderr, result.stderr


def test_kubectl_apply_on_deploy_k8s_applies_nothing() -> None:
    """`kubectl apply -f deploy/k8s/` once applied the demo Secret over a real one: now the
    folder holds only kustomizations, and the demo's own files name their namespace."""
    assert not [p.name for p in K8S.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json")]
    for path in sorted(K8S_DEV.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") not in ("Kustomization", "Namespace"):
                assert doc["metadata"].get("namespace") == DEV_NAMESPACE, f"{path.name}: {doc['kind']}"


def test_k8s_base_holds_only_what_production_runs() -> None:
    """No Secret, database, Redis or namespace in the base; the pods need a Secret of yours,
    every key of it, before they start (nothing falls back to a demo default)."""
    found = objects(K8S_BASE)
    assert {kind for kind, _ in found} == {
        "ConfigMap",
        "Deployment",
        "Service",
        "Ingress",
        "NetworkPolicy",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    assert {name for _, name in found} == {"ecoscan", "ecoscan-settings"}
    for document in found.values():
        assert "namespace" not in document["metadata"], document["kind"]
    (container,) = the("Deployment", found)["spec"]["template"]["spec"]["containers"]
    assert [s for s in container["envFrom"] if "secretRef" in s] == []
    # Every key mounted by name, none optional: a missing one stops the pod from starting.
    (volume,) = [v for v in the("Deployment", found)["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    secret = volume["secret"]
    assert not secret.get("optional", False)
    assert {item["key"] for item in secret["items"]} == OPERATORS_SECRET.keys()
    settings = base_settings()
    assert settings.database_url == OPERATORS_SECRET["DATABASE_URL"]
    assert settings.redis_url == OPERATORS_SECRET["REDIS_URL"]
    assert settings.openai_api_key == OPERATORS_SECRET["OPENAI_API_KEY"]
    assert settings.auth_jwt_secret == OPERATORS_SECRET["AUTH_JWT_SECRET"]


def test_k8s_dev_overlay_is_the_base_plus_the_demo_in_its_own_namespace() -> None:
    base, dev = objects(K8S_BASE), objects(K8S_DEV)
    assert base.keys() <= dev.keys()
    demo = {key for key in dev.keys() - base.keys() if key[0] != "Namespace"}
    assert demo == {
        ("Secret", "ecoscan-secrets"),
        ("Deployment", "postgres"),
        ("Service", "postgres"),
        ("Deployment", "redis"),
        ("Service", "redis"),
        # deploy/k8s/tracing: the trace backend, and where the pods send their traces.
        *objects(K8S_TRACING).keys(),
    }
    assert ("Namespace", DEV_NAMESPACE) in dev
    for (kind, name), document in dev.items():
        if kind != "Namespace":
            assert document["metadata"]["namespace"] == DEV_NAMESPACE, f"{kind}/{name}"
    # The overlay adds; it changes nothing the base says (but the namespace).
    for key, document in base.items():
        del dev[key]["metadata"]["namespace"]
        assert dev[key] == document, f"the dev overlay changes {key}"


def the(kind: str, found: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (doc,) = [doc for (k, _), doc in found.items() if k == kind]
    return doc


def the_named(kind: str, name: str, found: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    assert (kind, name) in found, f"no {kind}/{name}"
    return found[kind, name]


def k8s_env(found: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets from these objects (the ConfigMap, literal
    values), with each `*_FILE` that points into a mounted Secret pointed at a file holding
    that Secret's value instead (what the kubelet would mount there)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]
        if ref.get("optional") and ("ConfigMap", ref["name"]) not in found:
            continue  # as the kubelet does: an optional ConfigMap that is not there adds nothing
        env.update(the_named("ConfigMap", ref["name"], found)["data"])
    for item in container.get("env", []):
        assert "valueFrom" not in item, f"{item['name']}: a secret in the environment, not a file"
        env[item["name"]] = item.get("value", "")
    files = mounted_secret_files(found, container)
    for name, value in env.items():
        if name.endswith("_FILE") and value.startswith("/run/secrets/"):
            assert value in files, f"{name}={value}: no mounted Secret key there"
            env[name] = str(files[value])
    return env


K8S_SECRET_FILES = Path(tempfile.mkdtemp(prefix="ecoscan-k8s-secrets-"))


def mounted_secret_files(
    found: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> dict[str, Path]:
    """Path in the container -> a local file with that Secret key's value, for every
    Secret volume the container mounts (only its `items`, as the kubelet mounts them)."""
    pod = next(
        d["spec"]["template"]["spec"]
        for (kind, _), d in found.items()
        if kind == "Deployment" and container in d["spec"]["template"]["spec"]["containers"]
    )
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        assert mount.get("readOnly") is True, mount
        data = the_named("Secret", secret["secretName"], found).get("stringData", {})
        for item in secret["items"]:
            assert item["key"] in data, f"the Secret {secret['secretName']} has no key {item['key']}"
            local = K8S_SECRET_FILES / secret["secretName"] / item["path"]
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(data[item["key"]] + "\n")
            files[f"{mount['mountPath']}/{item['path']}"] = local
    return files


# A Secret of the operator's, as deployment.yaml's comment shows how to create it: the base
# has none, and its pods read every key of it.
OPERATORS_SECRET = {
    "DATABASE_URL": "postgresql://ecoscan:pw@db.example.internal:5432/ecoscan",
    "REDIS_URL": "redis://:pw@redis.example.internal:6379/0",
    "OPENAI_API_KEY": "sk-test",
    "AUTH_JWT_SECRET": "0123456789abcdef" * 4,
}


def base_settings() -> Settings:
    """The base's pods' settings, with the operator's Secret beside them."""
    found = objects(K8S_BASE)
    secret = {"kind": "Secret", "metadata": {"name": "ecoscan-secrets"}, "stringData": OPERATORS_SECRET}
    found["Secret", "ecoscan-secrets"] = secret
    return settings_from(k8s_env(found, ecoscan_container(found)), "deploy/k8s/base + a Secret")


def k8s_settings(found: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]) -> Settings:
    return settings_from(k8s_env(found, container), "deploy/k8s/overlays/dev: ConfigMap + Secret")


def ecoscan_container(found: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (container,) = the_named("Deployment", "ecoscan", found)["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_k8s_drain_fits_the_termination_grace_period() -> None:
    found = objects(K8S_DEV)
    pod = the_named("Deployment", "ecoscan", found)["spec"]["template"]["spec"]
    settings = k8s_settings(found, ecoscan_container(found))
    command = ecoscan_container(found)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # Endpoints are removed while preStop sleeps; then SIGTERM starts the drain.
    assert 2 <= pre_stop <= 15
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + settings.shutdown_drain_s + CLOSE_MARGIN_S
    assert settings.redis_prefix


def test_k8s_dev_secret_points_at_the_demo_services() -> None:
    found = objects(K8S_DEV)
    settings = k8s_settings(found, ecoscan_container(found))
    assert settings.uses_simulator, "the demo has no OpenAI key: the simulator"
    assert settings.database_url is not None and settings.redis_url is not None
    db_host, db_port = url_host_port(settings.database_url)
    postgres = the_named("Service", str(db_host), found)
    assert db_port == postgres["spec"]["ports"][0]["port"]
    (server,) = the_named("Deployment", str(db_host), found)["spec"]["template"]["spec"]["containers"]
    server_env = {item["name"]: item["value"] for item in server["env"]}
    server_files = mounted_secret_files(found, server)
    db_url = urllib.parse.urlsplit(settings.database_url)
    assert (db_url.username, db_url.password, db_url.path) == (
        server_env["POSTGRES_USER"],
        server_files[server_env["POSTGRES_PASSWORD_FILE"]].read_text().strip(),
        "/" + server_env["POSTGRES_DB"],
    )
    # Redis: the password in REDIS_URL is the one the demo server requires, read from
    # its own mount of the Secret, in protected mode.
    redis_host, redis_port = url_host_port(settings.redis_url)
    assert redis_port == the_named("Service", str(redis_host), found)["spec"]["ports"][0]["port"]
    (redis,) = the_named("Deployment", str(redis_host), found)["spec"]["template"]["spec"]["containers"]
    script = " ".join(redis["command"])
    (password_file,) = re.findall(r"requirepass \$\(cat (\S+)\)", script)
    redis_password = urllib.parse.urlsplit(settings.redis_url).password
    assert (
        redis_password
        and mounted_secret_files(found, redis)[password_file].read_text().strip() == redis_password
    )
    assert "--protected-mode yes" in script and "env" not in redis
    # The demo PostgreSQL takes the most pods there can be.
    args = server["args"]
    max_connections = int(args[args.index("-c") + 1].split("=", 1)[1])
    assert max_connections >= most_pods(found) * (fixed_pool(settings) + 1)


def fixed_pool(settings: Settings) -> int:
    """DB_POOL_MAX as the kit fixes it: with replicas, `auto` (half of what the server has
    free at each start) is no arithmetic to check."""
    pool = settings.limit("db_pool_max").fixed
    assert pool is not None, "the deploy kit fixes DB_POOL_MAX"
    return pool


def most_pods(found: dict[tuple[str, str], dict[str, Any]]) -> int:
    """Pods running at once at most: the autoscaler's maximum plus a rollout's surge."""
    surge = the_named("Deployment", "ecoscan", found)["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert isinstance(surge, int), "maxSurge as a count, so the arithmetic below holds"
    maximum: int = the("HorizontalPodAutoscaler", found)["spec"]["maxReplicas"]
    return maximum + surge


def test_k8s_database_connections_fit_a_managed_postgres() -> None:
    """The arithmetic configmap.yaml states: every pod's pool and LISTEN connection, at the
    most pods there can be, within a managed PostgreSQL's 100 connections less its
    superuser reservation and room for everything else."""
    found = objects(K8S_BASE)
    settings = base_settings()
    pool = fixed_pool(settings)
    per_pod = pool + 1  # the pool, and the rule cache's LISTEN connection
    available = MANAGED_POSTGRES_MAX_CONNECTIONS - POSTGRES_RESERVED_CONNECTIONS - OTHER_DATABASE_CLIENTS
    assert most_pods(found) * per_pod <= available, (most_pods(found), per_pod, available)
    assert settings.db_pool_min <= pool
    stated = f"{most_pods(found)} pods x ({pool} + 1) = {most_pods(found) * per_pod}"
    assert stated in (K8S_BASE / "configmap.yaml").read_text(), f"configmap.yaml should say {stated!r}"


def dockerfile_command() -> list[str]:
    """The image's CMD (exec form)."""
    (line,) = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("CMD [")]
    command: list[str] = json.loads(line.removeprefix("CMD"))
    return command


def uvicorn_options(command: list[str]) -> dict[str, Any]:
    """uvicorn's own reading of its command line (an unknown flag fails)."""
    assert command[0] == "uvicorn", command
    cli = importlib.import_module("uvicorn.main").main
    params: dict[str, Any] = cli.make_context("uvicorn", list(command[1:])).params
    return params


def test_k8s_keep_alive_outlasts_the_ingress() -> None:
    """uvicorn keeps idle connections longer than ingress-nginx does, so nginx never sends a
    request into a connection uvicorn is closing; the pods run the image's own command."""
    container = ecoscan_container(objects(K8S_BASE))
    assert "command" not in container
    assert container["args"] == dockerfile_command()
    options = uvicorn_options(container["args"])
    assert options["timeout_keep_alive"] > INGRESS_NGINX_UPSTREAM_KEEPALIVE_S
    assert (options["app"], options["port"], options["http"]) == (
        "app.main:app",
        8000,
        "app.http.protocol:HttpToolsProtocol",
    )


def test_k8s_ingress_terminates_tls() -> None:
    ingress = the("Ingress", objects(K8S_BASE))
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
    assert annotations["nginx.ingress.kubernetes.io/force-ssl-redirect"] == "true"
    covered = {host for tls in ingress["spec"]["tls"] if tls.get("secretName") for host in tls["hosts"]}
    hosts = [rule["host"] for rule in ingress["spec"]["rules"]]
    assert hosts and set(hosts) <= covered


def test_k8s_only_the_ingress_controller_and_prometheus_reach_the_pods() -> None:
    """FORWARDED_ALLOW_IPS trusts the pod network because the NetworkPolicy lets no pod but
    the ingress controller (and Prometheus) connect: both halves of that story."""
    found = objects(K8S_BASE)
    pod_labels = the("Deployment", found)["spec"]["template"]["metadata"]["labels"]
    policy = the("NetworkPolicy", found)["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    peers = {
        (
            peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        )
        for peer in rule["from"]
    }
    assert peers == {("ingress-nginx", "ingress-nginx"), ("monitoring", "prometheus")}
    assert len(rule["from"]) == len(peers)
    for peer in rule["from"]:
        assert set(peer) == {"namespaceSelector", "podSelector"}, peer  # no ipBlock, no "any"
    trusted = the_named("ConfigMap", "ecoscan-settings", found)["data"]["FORWARDED_ALLOW_IPS"]
    for entry in trusted.split(","):
        network = ipaddress.ip_network(entry.strip())  # never "*"
        assert network.is_private and network.prefixlen >= 12, f"{network}: a pod CIDR, not a whole range"


def test_k8s_pods_reach_only_dns_the_stores_and_public_https() -> None:
    """Egress: DNS to the cluster's DNS pods, PostgreSQL and Redis by port, traces (the
    namespace's Phoenix pods, or OTLP/HTTP's port), 443 to public addresses only: not the
    metadata service, the API server or other pods' HTTPS."""
    policy = the("NetworkPolicy", objects(K8S_BASE))["spec"]
    rules = policy["egress"]
    ports = [{(p["port"], p["protocol"]) for p in rule["ports"]} for rule in rules]
    assert ports == [
        {(53, "UDP"), (53, "TCP")},
        {(5432, "TCP"), (6379, "TCP")},
        {(PHOENIX_PORT, "TCP")},
        {(OTLP_HTTP_PORT, "TCP")},
        {(443, "TCP")},
    ]
    (dns,) = rules[0]["to"]
    assert dns["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}
    assert dns["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    # Phoenix's port to Phoenix's pods alone, in the pods' own namespace.
    (phoenix,) = rules[2]["to"]
    assert phoenix == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "phoenix"}}}
    blocks = [peer["ipBlock"] for peer in rules[4]["to"]]
    assert [b["cidr"] for b in blocks] == ["0.0.0.0/0", "::/0"]
    for address in ("169.254.169.254", "10.96.0.1", "172.20.0.1", "192.168.1.1", "100.64.0.1", "fd00::1"):
        ip = ipaddress.ip_address(address)
        block = next(b for b in blocks if ipaddress.ip_network(b["cidr"]).version == ip.version)
        assert any(ip in ipaddress.ip_network(e) for e in block["except"]), f"443 reaches {address}"
    public = ipaddress.ip_address("104.18.7.192")  # api.openai.com's CDN
    assert not any(public in ipaddress.ip_network(e) for e in blocks[0]["except"])


def test_k8s_tracing_points_the_pods_at_its_phoenix() -> None:
    """deploy/k8s/tracing beside the base (as the dev overlay has it): the pods' optional
    ConfigMap names the Service of a Phoenix pod on the port it serves, the pods' egress
    lets them reach it, and nothing else may connect to it, nor it anywhere. The base
    alone sends traces nowhere."""
    base = objects(K8S_BASE)
    base["Secret", "ecoscan-secrets"] = {"kind": "Secret", "metadata": {}, "stringData": OPERATORS_SECRET}
    assert not any(name.startswith(OTEL_PREFIX) for name in k8s_env(base, ecoscan_container(base)))
    found = objects(K8S_DEV)
    container = ecoscan_container(found)
    (ref,) = [
        s["configMapRef"] for s in container["envFrom"] if s["configMapRef"]["name"] == "ecoscan-tracing"
    ]
    assert ref.get("optional") is True
    env = k8s_env(found, container)
    k8s_settings(found, container)  # the rest still reads as settings
    assert env["OTEL_SERVICE_NAME"] == "ecoscan" and env["OTEL_TRACES_SAMPLER"] in OTEL_SAMPLERS
    assert 0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1
    host, port = url_host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert host is not None
    service = the_named("Service", host, found)["spec"]
    (service_port,) = [p for p in service["ports"] if p["port"] == port]
    backend = the_named("Deployment", "phoenix", found)["spec"]
    labels = backend["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    (phoenix,) = backend["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in phoenix["ports"]}
    assert ports.get(service_port["targetPort"], service_port["targetPort"]) == PHOENIX_PORT
    # One pod with its SQLite on a volume: never two at once.
    assert backend["replicas"] == 1 and backend["strategy"]["type"] == "Recreate"
    pod = backend["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == PHOENIX_UID
    assert phoenix["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"]: m["name"] for m in phoenix["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes[mounts["/var/lib/phoenix"]]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in found

    # The pods may connect to it...
    egress = the_named("NetworkPolicy", "ecoscan", found)["spec"]["egress"]
    assert any(
        any(
            peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
            for peer in rule["to"]
        )
        and {(p["port"], p["protocol"]) for p in rule["ports"]} == {(PHOENIX_PORT, "TCP")}
        for rule in egress
        if "to" in rule
    ), egress
    # ...and only they: its own policy admits the ecoscan pods alone and lets it reach nothing.
    policy = the_named("NetworkPolicy", "phoenix", found)["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    pod_labels = the_named("Deployment", "ecoscan", found)["spec"]["template"]["metadata"]["labels"]
    assert set(peer) == {"podSelector"} and peer["podSelector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize("kustomization", [K8S_BASE, K8S_DEV], ids=["base", "dev"])
def test_k8s_no_path_from_the_ingress_to_gateway_trust(kustomization: Path) -> None:
    """Every rendered kit authenticates bearer tokens (AUTH_MODE=jwt with its key mounted
    as a file): nothing believes an X-User-ID that came through the Ingress. Secrets are
    files, none in any container's environment."""
    found = objects(kustomization)
    config = the_named("ConfigMap", "ecoscan-settings", found)["data"]
    assert config["AUTH_MODE"] == "jwt"
    assert "AUTH_GATEWAY_SECRET" not in config and "AUTH_GATEWAY_SECRET_FILE" not in config
    container = ecoscan_container(found)
    env = {item["name"]: item for item in container["env"]}
    assert env["AUTH_JWT_SECRET_FILE"]["value"].startswith("/run/secrets/")
    assert "AUTH_MODE" not in env  # the ConfigMap's, not overridden
    for doc in found.values():
        if doc["kind"] != "Deployment":
            continue
        for each in doc["spec"]["template"]["spec"]["containers"]:
            for item in each.get("env", []):
                assert "valueFrom" not in item, f"{doc['metadata']['name']}: {item['name']} from a Secret"
            assert "envFrom" not in each or all("secretRef" not in s for s in each["envFrom"])
    if (("Secret", "ecoscan-secrets")) in found:
        settings = k8s_settings(found, container)
        assert settings.auth_mode == "jwt" and settings.auth_jwt_secret
        assert settings.auth_allow_anonymous is True
        assert settings.user_scan_rate_per_min > 0 and settings.user_daily_scan_quota > 0
    # The Ingress routes no probe, and retries a POST only when no pod got it.
    ingress = the("Ingress", found)
    retries = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-next-upstream"]
    assert "non_idempotent" not in retries.split()


def test_k8s_probes_and_references_agree() -> None:
    found = objects(K8S_BASE)
    deployment = the("Deployment", found)
    template = deployment["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    container = ecoscan_container(found)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000 == uvicorn_options(container["args"])["port"]

    def probe(name: str) -> tuple[str, int]:
        get = container[name]["httpGet"]
        return get["path"], ports.get(get["port"], get["port"])

    assert probe("readinessProbe") == ("/readyz", 8000)
    assert probe("livenessProbe") == ("/healthz", 8000)
    assert probe("startupProbe") == ("/healthz", 8000)
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])

    def selects_pods(selector: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= pod_labels.items()

    assert selects_pods(deployment["spec"]["selector"]["matchLabels"])
    service = the("Service", found)
    assert selects_pods(service["spec"]["selector"])
    assert service["spec"]["ports"][0]["targetPort"] in (ports["http"], "http")
    pdb = the("PodDisruptionBudget", found)
    assert selects_pods(pdb["spec"]["selector"]["matchLabels"])
    hpa = the("HorizontalPodAutoscaler", found)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    # The autoscaler owns the count, at least REPLICAS (a count in the Deployment would
    # reset it on every apply); evictions can always proceed one at a time.
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["minReplicas"] >= REPLICAS and pdb["spec"].get("maxUnavailable") == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # The Ingress sends the API to the Service, keeps /metrics private and fits SSE.
    ingress = the("Ingress", found)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    body_limit = size_bytes(annotations["nginx.ingress.kubernetes.io/proxy-body-size"])
    assert body_limit >= max_body_bytes(base_settings())
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"]
            assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
            for private in ("/metrics", "/healthz", "/readyz"):
                assert not ingress_path_matches(path, private), f"the Ingress exposes {private}"


def ingress_path_matches(rule: dict[str, Any], request_path: str) -> bool:
    """Whether an Ingress path rule (Exact or Prefix, by path elements) takes this path."""
    if rule["pathType"] == "Exact":
        return bool(request_path == rule["path"])
    prefix = rule["path"].rstrip("/")
    return prefix == "" or request_path == prefix or request_path.startswith(prefix + "/")


# The PodMonitor fields used here (monitoring.coreos.com/v1; the CRD's schema is not among
# kubernetes-validate's): anything else is a typo the operator would drop in silence.
POD_MONITOR_SPEC_KEYS = frozenset({"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector"})
POD_MONITOR_ENDPOINT_KEYS = frozenset({"port", "path", "interval", "scrapeTimeout", "scheme"})


def test_k8s_pod_monitor_scrapes_every_pod() -> None:
    """The CRD object's shape by hand, and that it finds the base's pods on their metrics
    port and labels them job="ecoscan" as compose's Prometheus does (the dashboard and the
    alert rules select that job)."""
    (monitor,) = kustomize(K8S_MONITORING)
    assert (monitor["apiVersion"], monitor["kind"]) == (PROMETHEUS_OPERATOR_API, "PodMonitor")
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["name"] and "namespace" not in monitor["metadata"]
    spec = monitor["spec"]
    assert set(spec) <= POD_MONITOR_SPEC_KEYS and {"selector", "podMetricsEndpoints"} <= set(spec)
    base = objects(K8S_BASE)
    template = the("Deployment", base)["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert "namespaceSelector" not in spec  # the monitor's own namespace: the app's
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) <= POD_MONITOR_ENDPOINT_KEYS
    (container,) = template["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint.get("path", "/metrics") == "/metrics"
    assert seconds(endpoint["scrapeTimeout"]) < seconds(endpoint["interval"]) <= 30
    job = template["metadata"]["labels"][spec["jobLabel"]]
    compose_jobs = [job["job_name"] for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]]
    assert job == "ecoscan" and job in compose_jobs
