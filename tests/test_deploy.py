"""deploy/: the compose stack, the Kubernetes manifests and the Grafana dashboard, checked
offline with the real tools where they exist and with schemas always.

- compose.yaml: `docker-compose config` (Debian's docker-compose 1.29, or the docker
  compose v2 plugin when present) and the Compose Specification's JSON schema as vendored
  by check-jsonschema; a misspelt key must fail both. Then what the stack relies on: the
  balancer's settings for SSE, the grace periods against the drain, the settings each
  replica gets (its env file, the wiring, the secrets deploy/make-secrets.sh makes, read
  through `Settings.from_env`, so a misspelt variable fails), images built here rather
  than pulled, the Prometheus and Grafana files. tests/test_compose_up.py brings it up.
- k8s/: every manifest against the Kubernetes schemas kubernetes-validate bundles (strict:
  unknown fields fail), then the drain arithmetic, probes and the references between them.
- the dashboard: every PromQL expression parses (promql-parser) and names only metrics a
  running service exports (scraped from /metrics after a scan) with labels they carry.
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import json
import re
import shutil
import subprocess
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
import uvicorn
import yaml  # type: ignore[import-untyped]
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from app.http.protocol import HttpToolsProtocol
from app.images.limits import ImageLimits
from app.intake.parsing import InputLimits
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
    image = ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_pixels=settings.image_max_pixels,
        long_side=settings.image_long_side,
        jpeg_quality=settings.image_jpeg_quality,
    )
    return InputLimits(image=image, user_input_max_chars=settings.user_input_max_chars).max_body_bytes


def settings_env_names() -> set[str]:
    """Every environment variable the service reads: Settings' own and uvicorn's."""
    names = {env_name(f.name) for f in dataclasses.fields(Settings) if not f.metadata.get("env_prefix")}
    return names | {f"{env_name(name)}_FILE" for name in FILE_SETTINGS} | {"FORWARDED_ALLOW_IPS"}


def settings_from(env: Mapping[str, str], where: str) -> Settings:
    """Settings as the service would read them from `env`; unknown names are mistakes."""
    unknown = {k for k in env if k not in settings_env_names() and not k.startswith("SIM_")}
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
    assert {"ecoscan", "lb", "postgres", "redis", "prometheus", "grafana"} <= services.keys()
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
    # The default models' Tier 1 limits (README "Models"): gpt-4o-mini has 200k TPM.
    assert (settings.vision_model, settings.answer_model) == ("gpt-4o-mini", "gpt-4o-mini")
    assert (settings.openai_rpm, settings.openai_tpm) == (500, 200_000)
    # PostgreSQL takes every replica's pool (and its LISTEN connection) with room to scale.
    command = services["postgres"]["command"]
    max_connections = int(command[command.index("-c") + 1].split("=", 1)[1])
    assert max_connections >= 10 * (settings.db_pool_max + 1)


def test_no_secret_is_in_any_environment(compose: dict[str, Any], secrets_dir: Path) -> None:
    """Secrets reach the services as files (compose secrets), never as values."""
    secret_values = {path.read_text().strip() for path in secrets_dir.iterdir()} - {""}
    secret_names = {"DATABASE_URL", "OPENAI_API_KEY", "AUTH_JWT_SECRET", "POSTGRES_PASSWORD"}
    for name, service in compose["services"].items():
        env = environment(service)
        if name == "ecoscan":
            env = {**env_file(DEPLOY / service["env_file"][0]), **env}
        assert not secret_names & env.keys(), f"{name}: {sorted(secret_names & env.keys())}"
        assert not [k for k in env if "PASSWORD" in k and not k.endswith("FILE")], name
        assert not secret_values & set(env.values()), name
        # Redis is reachable on the compose network only, without a password; one would
        # make REDIS_URL a secret (REDIS_URL_FILE).
        assert urllib.parse.urlsplit(env.get("REDIS_URL", "")).password is None, name
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"], f"{name} mounts an undeclared secret {secret}"
    # deploy/make-secrets.sh makes every secret compose.yaml declares, and nothing in git.
    for secret in compose["secrets"].values():
        assert Path(secret["file"]).name in {p.name for p in secrets_dir.iterdir()}
        assert Path(secret["file"]).parent == Path("./secrets")
    assert "deploy/secrets/" in (REPO / ".gitignore").read_text().splitlines()


def test_jwt_mode_as_the_env_file_describes_it_starts(compose: dict[str, Any], secrets_dir: Path) -> None:
    """ecoscan.env's recipe for public use (AUTH_MODE=jwt with the mounted HS256 secret)
    gives settings the service accepts: a replica started with it does not restart-loop."""
    recipe = [
        line.lstrip("#").strip()
        for line in (DEPLOY / "ecoscan.env").read_text().splitlines()
        if line.lstrip("#").strip().startswith(("AUTH_MODE=jwt", "AUTH_JWT_SECRET_FILE="))
    ]
    assert len(recipe) == 2, recipe
    env = {**replica_environment(compose, secrets_dir)}
    for line in recipe:
        name, value = line.split("=", 1)
        env[name] = value
    secret = env["AUTH_JWT_SECRET_FILE"]
    assert secret == "/run/secrets/auth_jwt_secret"
    assert "auth_jwt_secret" in compose["services"]["ecoscan"]["secrets"]
    env["AUTH_JWT_SECRET_FILE"] = str(secrets_dir / "auth_jwt_secret")
    settings = settings_from(env, "ecoscan.env with its AUTH_MODE=jwt lines")
    assert settings.auth_mode == "jwt" and settings.auth_jwt_secret


def test_the_network_and_the_balancers_address(compose: dict[str, Any], secrets_dir: Path) -> None:
    services = compose["services"]
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
    # ...closed by nginx before uvicorn's idle timeout closes them under a request.
    keepalive_timeout = re.search(r"\bkeepalive_timeout\s+(\S+);", upstream)
    assert keepalive_timeout
    uvicorn_idle = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default
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


def test_load_balancer_takes_the_largest_body_and_retries_only_refusals() -> None:
    d = nginx_directives()
    limit = size_bytes(d["client_max_body_size"][0])
    largest = max_body_bytes(Settings())
    # The service answers oversized bodies itself (JSON 413): nginx must let them through.
    assert largest <= limit <= 2 * largest
    retried_on = d["proxy_next_upstream"][0].split()
    assert {"error", "http_503", "non_idempotent"} <= set(retried_on)
    assert not {"http_500", "http_502", "http_504", "http_429"} & set(retried_on)
    assert 2 <= int(d["proxy_next_upstream_tries"][0]) <= 3
    # A request retried elsewhere must be whole: nginx buffers it before passing it on.
    assert d.get("proxy_request_buffering", ["on"]) == ["on"]
    assert "max_fails=0" in nginx_block("upstream ecoscan")


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


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query; Grafana's variables replaced by values."""

    def grafana_variable(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        assert name in GRAFANA_VARIABLES, f"unknown Grafana variable ${name}"
        return GRAFANA_VARIABLES[name]

    for panel in panels():
        for target in panel.get("targets", []):
            yield panel["title"], re.sub(r"\$\{(\w+)\}|\$(\w+)", grafana_variable, target["expr"])


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


async def test_dashboard_charts_only_metrics_the_service_exports(exposition: tuple[str, Metrics]) -> None:
    series = exported_series(*exposition)
    charted: set[str] = set()
    problems: list[str] = []
    for title, query in dashboard_queries():
        try:
            expr = promql_parser.parse(query)
        except Exception as exc:  # the parser raises a plain ValueError-like error
            problems.append(f"{title}: {query!r} is not PromQL: {exc}")
            continue
        for selector in selectors(expr):
            name = selector_name(selector)
            charted.add(name)
            if name in PROMETHEUS_SERIES:
                continue
            if name not in series:
                problems.append(f"{title}: {name} is not exported")
                continue
            labels = {m.name for m in selector.matchers.matchers} - {"__name__"}
            unknown = labels - series[name] - TARGET_LABELS
            if unknown:
                problems.append(f"{title}: {name} has no label {sorted(unknown)}")
        for aggregation in aggregations(expr):
            if aggregation.modifier is None or aggregation.modifier.type != promql_parser.AggModifierType.By:
                continue
            names = [selector_name(s) for s in selectors(aggregation.expr)]
            available = set(TARGET_LABELS).union(*(series.get(n, set()) for n in names))
            unknown = set(aggregation.modifier.labels) - available
            if unknown:
                problems.append(f"{title}: `by ({', '.join(sorted(unknown))})` over {names}: no such label")
    assert not problems, "\n".join(problems)
    assert not DASHBOARD_MUST_CHART - charted, sorted(DASHBOARD_MUST_CHART - charted)
    # The replica picker's values come from an exported metric too.
    (variable,) = dashboard()["templating"]["list"]
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    match = re.fullmatch(r"label_values\((\w+),\s*instance\)", query)
    assert match and match[1] in series, query


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


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    found = [
        (path, doc)
        for path in sorted(K8S.rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    assert found, "no manifests in deploy/k8s"
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
def test_k8s_manifests_match_the_kubernetes_schemas(version: str) -> None:
    errors = []
    for path, document in k8s_documents():
        error = k8s_errors(document, version)
        if error:
            errors.append(
                f"{path.relative_to(REPO)} {document['kind']}/{document['metadata']['name']}: {error}"
            )
    assert not errors, "\n".join(errors)


def test_k8s_schema_check_rejects_broken_manifests() -> None:
    text = (K8S / "deployment.yaml").read_text()
    for old, new in (
        ("readinessProbe:", "readinesProbe:"),
        ("terminationGracePeriodSeconds: 45", "terminationGracePeriodSeconds: soon"),
        ("maxUnavailable: 0", "maxUnavailable: [0]"),
    ):
        assert k8s_errors(yaml.safe_load(mutated(text, old, new)), K8S_VERSIONS[-1]), f"accepted {new!r}"


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """The production manifests (deploy/k8s/*.yaml, not demo/) by (kind, name)."""
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    }


def the(kind: str, found: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (doc,) = [doc for (k, _), doc in found.items() if k == kind]
    return doc


def k8s_settings(found: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]) -> Settings:
    env: dict[str, str] = {}
    for source in container["envFrom"]:
        if "configMapRef" in source:
            env.update(found["ConfigMap", source["configMapRef"]["name"]]["data"])
        else:
            env.update(found["Secret", source["secretRef"]["name"]]["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "")
    return settings_from(env, "deploy/k8s ConfigMap + Secret")


def test_k8s_drain_fits_the_termination_grace_period() -> None:
    found = manifests()
    pod = the("Deployment", found)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = k8s_settings(found, container)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # Endpoints are removed while preStop sleeps; then SIGTERM starts the drain.
    assert 2 <= pre_stop <= 15
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + settings.shutdown_drain_s + CLOSE_MARGIN_S
    assert settings.redis_url is not None and settings.database_url is not None
    assert settings.redis_prefix


def test_k8s_probes_and_references_agree() -> None:
    found = manifests()
    deployment = the("Deployment", found)
    template = deployment["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000

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
    # The HPA owns the replica count; evictions can always proceed one at a time.
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"].get("maxUnavailable") == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # The Ingress sends the API to the Service, keeps /metrics private and fits SSE.
    ingress = the("Ingress", found)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    body_limit = size_bytes(annotations["nginx.ingress.kubernetes.io/proxy-body-size"])
    assert body_limit >= max_body_bytes(k8s_settings(found, container))
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
